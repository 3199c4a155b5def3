#!/usr/bin/env bash
# A keep-alive run: return when the chain ends or after ~9.5 minutes, with the log tail.
for _ in $(seq 1 114); do
  grep -q "CHAIN_DONE\|CHAIN_FAILED" /root/results/chain.log 2>/dev/null && break
  sleep 5
done
tail -n 40 /root/results/chain.log
ls /root/results
