#!/usr/bin/env bash
# The last staging run: join the GGUF, copy the code aside and start the chain detached.
set -euo pipefail
bash scripts/gpu/gguf.sh
rm -rf /root/deepflash && mkdir -p /root/deepflash /root/results
cp -r deepflash scripts tests pyproject.toml /root/deepflash/
cd /root/deepflash
setsid nohup bash scripts/gpu/chain.sh > /root/results/chain.log 2>&1 < /dev/null &
sleep 20
cat /root/results/chain.log
