#!/usr/bin/env bash
# A staging call: keep what it carried on the machine (GGUF parts, token data, drafters) in /root/stage, and
# install the carried wheels. Quick, so that the next call comes within the machine's 30 s idle release.
set -euo pipefail
mkdir -p /root/stage
for part in .stage/part[0-9][0-9]; do [ -f "$part" ] && cp "$part" /root/stage/; done
# token shards made earlier (collect.sh data), carried as data.tgz.part* over several calls where they do not
# fit beside the working tree at once; each call joins the parts it has, the last completes the file
if ls .stage/data.tgz.part* >/dev/null 2>&1; then
  cp .stage/data.tgz.part* /root/stage/
  cat /root/stage/data.tgz.part* > /root/stage/data.tgz
fi
# drafters to continue or to measure: .stage/arm-a, .stage/arm-b (collect.sh arms), .stage/candidate
for drafter in .stage/candidate .stage/arm-a .stage/arm-b; do
  [ -d $drafter ] && rm -rf /root/stage/${drafter#.stage/} && cp -r $drafter /root/stage/
done
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version,serial --format=csv,noheader
