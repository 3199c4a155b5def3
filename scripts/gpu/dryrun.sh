#!/usr/bin/env bash
# The GPU chain on this CPU with tiny sizes: catches mistakes before they cost device time.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tmp=${1:-/tmp/deepflash-dryrun}
rm -rf "$tmp" && mkdir -p "$tmp"
cp -r deepflash scripts pyproject.toml "$tmp/"
cd "$tmp"
sed -i "s|export PYTHONPATH=/root/deepflash:/root/site|export PYTHONPATH=$tmp|; s|export DEEPFLASH_CACHE=/root/cache|export DEEPFLASH_CACHE=\${DEEPFLASH_CACHE:-$HOME/.cache/deepflash}|" scripts/gpu/env.sh
ROOT=$tmp DEVICE=cpu COUNT=12 MAX_NEW=24 TRAIN_MINUTES=0.3 LAYERS=1 BATCH_TOKENS=1000 PICK_PROMPTS=2 \
  ACCEPT_ARGS="--humaneval 2 --depths 1024 --per-depth 1 --recall 1024:600 --max-new-tokens 16" \
  SPEED_ARGS="--prompts 2 --long-depth 1024 --max-new-tokens 16 --part engines" \
  SMOKE_ARGS="--prompts 2 --max-new-tokens 12" bash scripts/gpu/chain.sh
