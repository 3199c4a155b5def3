#!/usr/bin/env bash
# Run 1: keep the first half of the GGUF on the machine, and meanwhile run the benchmarks that need
# neither the embedded model nor the trained drafter (results come back in this run's $OUT).
set -uo pipefail
mkdir -p /root/stage && cp .stage/part00 /root/stage/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m deepflash.cli bench rings --out "$OUT/rings.json" 2>&1 | tail -n 25
python3 -m deepflash.cli bench hybrid --out "$OUT/hybrid.json" 2>&1 | tail -n 20
python3 -m deepflash.cli bench speed --part mbu --out "$OUT/speed-mbu.json" 2>&1 | tail -n 8
