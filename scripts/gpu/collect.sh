#!/usr/bin/env bash
# Last run: results (JSON, PNG, logs) as one archive, the drafter's weights and the generated data split
# under the 16 MiB limit.
set -uo pipefail
cd /root/deepflash
cp /root/run/train.jsonl /root/results/train.jsonl 2>/dev/null
cp /root/run-b/train.jsonl /root/results/train-b.jsonl 2>/dev/null
cp /root/data/summary.json /root/results/data-summary.json 2>/dev/null
tar czf "$OUT/results.tgz" -C /root results
D=deepflash/drafters/smollm2-135m
if [ -f $D/model.safetensors ]; then
  cp $D/config.json $D/training.json "$OUT/" 2>/dev/null
  split -b 15000000 -d $D/model.safetensors "$OUT/drafter.part"
fi
# the run's own drafter where pick kept another: a later session can continue it (carried as
# .stage/candidate, INIT_FROM=/root/stage/candidate); without this the sixteenth session lost its 5-layer one
C=/root/run/drafter
if [ -f $C/model.safetensors ] && ! cmp -s $C/model.safetensors $D/model.safetensors; then
  cp $C/config.json "$OUT/candidate-config.json"
  cp $C/training.json "$OUT/candidate-training.json" 2>/dev/null
  split -b 15000000 -d $C/model.safetensors "$OUT/candidate.part"
fi
# the generated token shards, for the next session's run 1 to carry (.stage/data.tgz; never committed)
[ -f /root/data.tgz ] && split -b 15000000 -d /root/data.tgz "$OUT/data.tgz.part"
ls -l "$OUT"
