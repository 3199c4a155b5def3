#!/usr/bin/env bash
# What a chain made, into $OUT, in pieces under the limits of what a call brings back (8 files, 16 MiB each):
#   collect.sh            results (JSON, logs, the drafters' config.json and training.json) as one archive and
#                         the picked drafter's weights in 15 MB parts (wait.sh runs this once pick has run)
#   collect.sh candidate  the run's own drafter where pick kept another, to continue it later (carried as
#                         .stage/candidate, INIT_FROM=/root/stage/candidate)
#   collect.sh arms       while training: each arm's latest checkpoint exported as a drafter (its weight average
#                         where the run keeps one), arm-a.part*, arm-b.part*, with the results and its
#                         config.json and training.json as results/arm-*-config.json, -training.json (wait.sh
#                         runs this before pick, should the machine go back before the chain ends)
#   collect.sh data [N]   the generated token shards as data.tgz.part* (15 MB each), for a later chain to carry
#                         (.stage/data.tgz.part*; not committed): parts N.. (default 0), four per call
set -uo pipefail
cd /root/deepflash
D=deepflash/drafters/smollm2-135m
C=/root/run/drafter
case "${1:-results}" in
  results)
    cp /root/run/train.jsonl /root/results/train.jsonl 2>/dev/null
    cp /root/run-b/train.jsonl /root/results/train-b.jsonl 2>/dev/null
    cp /root/data/summary.json /root/results/data-summary.json 2>/dev/null
    for f in config.json training.json; do
      cp $D/$f /root/results/drafter-$f 2>/dev/null
      cp $C/$f /root/results/candidate-$f 2>/dev/null
    done
    tar czf "$OUT/results.tgz" -C /root results
    [ -f $D/model.safetensors ] && split -b 15000000 -d $D/model.safetensors "$OUT/drafter.part" ;;
  arms)
    source scripts/gpu/env.sh
    for arm in a b; do
      run=/root/run$([ $arm = b ] && echo -b)
      [ -f $run/checkpoint.pt ] || continue
      cp $run/train.jsonl /root/results/train-$arm.jsonl 2>/dev/null
      rm -rf /root/arm-$arm
      # the weight average where the run keeps one (what a pick would ship), else the latest weights
      { deepflash train-drafter export --run $run --ema --out /root/arm-$arm > /dev/null 2>&1 \
        || deepflash train-drafter export --run $run --out /root/arm-$arm > /dev/null; } \
        && split -b 15000000 -d /root/arm-$arm/model.safetensors "$OUT/arm-$arm.part" \
        && cp /root/arm-$arm/config.json /root/results/arm-$arm-config.json \
        && cp /root/arm-$arm/training.json /root/results/arm-$arm-training.json
    done
    tar czf "$OUT/results.tgz" -C /root results ;;
  candidate)
    if [ -f $C/model.safetensors ] && ! cmp -s $C/model.safetensors $D/model.safetensors; then
      split -b 15000000 -d $C/model.safetensors "$OUT/candidate.part"
    else
      echo "no candidate: the run's drafter is the one picked, or there is none"
    fi ;;
  data)
    rm -rf /root/data-parts && mkdir /root/data-parts
    [ -f /root/data.tgz ] && split -b 15000000 -d /root/data.tgz /root/data-parts/data.tgz.part
    ls /root/data-parts | sort | tail -n +$((${2:-0} + 1)) | head -n 4 | while read -r part; do
      cp /root/data-parts/$part "$OUT/"
    done ;;
  *)
    echo "collect.sh [results|arms|candidate|data [N]]" >&2; exit 2 ;;
esac
ls -l "$OUT"
