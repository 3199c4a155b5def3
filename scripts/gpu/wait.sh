#!/usr/bin/env bash
# A keep-alive call while the chain runs: hand the carried code to the chain (it switches to it between
# stages, keeping the drafter it picked), then return when the chain ends, when its log shows $1 (e.g.
# " train: start"), or after ~9.5 minutes, with the log tail; and bring back what the chain made so far.
if [ ! -f /root/results/chain.log ]; then
  echo "wait.sh: no chain on this machine (/root/results/chain.log is missing): the machine start.sh ran" \
    "on was given back; what earlier calls brought back is all there is" >&2
  exit 3
fi
mkdir -p /root/next && tar cf - deepflash scripts | tar xf - -C /root/next && touch /root/next/READY
until_seen=${1:-CHAIN_DONE}
for _ in $(seq 1 114); do
  grep -q "CHAIN_DONE\|CHAIN_FAILED\|$until_seen" /root/results/chain.log 2>/dev/null && break
  sleep 5
done
tail -n 40 /root/results/chain.log
ls /root/results
# once a drafter is picked, every call also collects it (about a second), should the machine go back; while
# training, the arms' latest checkpoints; before that, the results so far
if grep -q "CHAIN_DONE\|CHAIN_FAILED\| pick: rc=" /root/results/chain.log 2>/dev/null; then
  bash scripts/gpu/collect.sh
elif grep -q " train: start" /root/results/chain.log; then
  bash scripts/gpu/collect.sh arms
else
  tar czf "$OUT/results.tgz" -C /root results
fi
true
