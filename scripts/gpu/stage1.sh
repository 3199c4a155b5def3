#!/usr/bin/env bash
# Staging runs: keep the carried parts of the GGUF (the working tree and a part must fit in 64 MiB, so
# it travels in three) and the carried data on the machine, and install the carried wheels (quick, so
# that the chain starts at once; the GPU work all happens in the chain).
set -euo pipefail
mkdir -p /root/stage
for part in .stage/part0*; do [ -f "$part" ] && cp "$part" /root/stage/; done
# token shards an earlier session generated (collect.sh), if carried: the chain then skips datagen. Whole,
# or as collect.sh's data.tgz.part* over several runs once the whole no longer fits beside the working
# tree (each run joins the parts it has; the last one completes the file)
[ -f .stage/data.tgz ] && cp .stage/data.tgz /root/stage/
if ls .stage/data.tgz.part* >/dev/null 2>&1; then
  cp .stage/data.tgz.part* /root/stage/
  cat /root/stage/data.tgz.part* > /root/stage/data.tgz
fi
# drafters an earlier session trained and did not ship: .stage/candidate (collect.sh candidate), to continue
# (INIT_FROM=/root/stage/candidate), and .stage/arm-a, .stage/arm-b (collect.sh arms, from a machine that
# went back before pick), to measure; each arm fits beside the working tree in a run of its own
for drafter in .stage/candidate .stage/arm-a .stage/arm-b; do
  [ -d $drafter ] && rm -rf /root/stage/${drafter#.stage/} && cp -r $drafter /root/stage/
done
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
