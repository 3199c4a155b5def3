#!/usr/bin/env bash
# Run 1: keep the first half of the GGUF on the machine and install the carried wheels (quick, so that
# run 2 can start the chain at once; the GPU work all happens in the chain).
set -euo pipefail
mkdir -p /root/stage && cp .stage/part00 /root/stage/
# token shards an earlier session generated (collect.sh), if carried: the chain then skips datagen
[ -f .stage/data.tgz ] && cp .stage/data.tgz /root/stage/
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
