#!/usr/bin/env bash
# Last run: results (JSON, PNG, logs) as one archive, the drafter's weights split under the 16 MiB limit.
set -uo pipefail
cd /root/deepflash
cp -r /root/run-l3/train.jsonl /root/results/train-l3.jsonl 2>/dev/null
cp -r /root/run-l1/train.jsonl /root/results/train-l1.jsonl 2>/dev/null
cp /root/data/summary.json /root/results/data-summary.json 2>/dev/null
tar czf "$OUT/results.tgz" -C /root results
D=deepflash/drafters/smollm2-135m
if [ -f $D/model.safetensors ]; then
  cp $D/config.json $D/training.json "$OUT/" 2>/dev/null
  split -b 15000000 -d $D/model.safetensors "$OUT/drafter.part"
fi
ls -l "$OUT"
