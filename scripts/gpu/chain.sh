#!/usr/bin/env bash
# Drafter training and the benchmarks in one detached chain (started by start.sh), so that the GPU machine
# never idles between stages. Each stage logs to $ROOT/results/<stage>.log; a failed stage does not stop the
# ones after it (except training, which the benchmarks need). Between stages the chain switches to code that
# a wait.sh call left in $ROOT/next. Sizes come from the environment, so that dryrun.sh runs the same chain on
# a CPU. Defaults: the recipe of the shipped drafter's last training step (README.md in this folder).
set -uo pipefail
source scripts/gpu/env.sh
ROOT=${ROOT:-/root}
DEVICE=${DEVICE:-cuda}
COUNT=${COUNT:-2500}  # datagen, when no data was carried
MAX_NEW=${MAX_NEW:-320}
GEN_ARGS=${GEN_ARGS:-}  # more train-drafter generate arguments for that stage
TRAIN_MINUTES=${TRAIN_MINUTES:-10}
LR=${LR:-3e-4}
LAYERS=${LAYERS:-3}  # for a drafter trained from scratch (INIT_FROM=); --init-from keeps its own
BATCH_TOKENS=${BATCH_TOKENS:-16384}
TRAIN_EXTRA=${TRAIN_EXTRA---ema 0.998 --repeat-anchors --long-share 0.4}
PICK_PROMPTS=${PICK_PROMPTS:-164}
ACCEPT_ARGS=${ACCEPT_ARGS:---humaneval 164 --depths 1024,7500 --per-depth 5 --max-new-tokens 128}
SPEED_ARGS=${SPEED_ARGS:---prompts 5 --max-new-tokens 128}
R=$ROOT/results
DATA=$ROOT/data
RUN=$ROOT/run
mkdir -p "$R"
refresh() {  # take the code a wait.sh call carried, keeping the drafter the chain picked
  [ -f $ROOT/next/READY ] || return 0
  rm $ROOT/next/READY
  tar cf - -C $ROOT/next --exclude=deepflash/drafters deepflash scripts | tar xf -
  echo "=== $(date +%T) switched to the newest carried code"
}
stage() {  # stage NAME COMMAND...
  local name=$1; shift
  refresh
  echo "=== $(date +%T) $name: start"
  "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "=== $(date +%T) $name: rc=$rc"
  tail -n 4 "$R/$name.log"
  return $rc
}

# training continues from the shipped drafter (train_chain.sh), and pick weighs every candidate against it
rm -rf $ROOT/shipped-drafter && cp -r deepflash/drafters/smollm2-135m $ROOT/shipped-drafter
# CANDIDATES (drafter folders): no data and no training, pick among them and the shipped drafter, then
# measure (e.g. the arms collect.sh brought back from a machine that went back before pick, carried as
# .stage/arm-a: CANDIDATES=/root/stage/arm-a). CANDIDATES=none: no pick either, only the benchmarks of the
# working tree's drafter.
if [ "${CANDIDATES:-}" = none ]; then
  echo "=== $(date +%T) candidates: none, measuring the working tree's drafter"
elif [ -n "${CANDIDATES:-}" ]; then
  echo "=== $(date +%T) candidates: $CANDIDATES"
else
  source scripts/gpu/train_chain.sh
fi
[ "${CANDIDATES:-}" = none ] || stage pick python3 scripts/gpu/pick_drafter.py $CANDIDATES $ROOT/shipped-drafter \
  --device $DEVICE --prompts $PICK_PROMPTS --into deepflash/drafters/smollm2-135m --out $R/pick.json \
  || { echo "CHAIN_FAILED: no drafter"; exit 1; }
# SWEEP_ARGS (bench accept arguments, e.g. "--humaneval 1 --depths 7500 --per-depth 24 --max-new-tokens 128"):
# each drafter of SWEEP_DRAFTERS (default: the run's weight average and the shipped drafter) on the same prompts,
# in accept-NAME.json (NAME: its path under $ROOT, / as -), so that drafters and windows pair up prompt by prompt
for drafter in ${SWEEP_ARGS:+${SWEEP_DRAFTERS:-$RUN/drafter-ema $ROOT/shipped-drafter}}; do
  name=${drafter#$ROOT/} && name=${name//\//-}
  stage sweep-$name deepflash bench accept --device $DEVICE --draft $drafter --out $R/accept-$name.json $SWEEP_ARGS
done
stage accept deepflash bench accept --device $DEVICE --out $R/accept.json $ACCEPT_ARGS
stage speed deepflash bench speed --device $DEVICE --part engines --out $R/speed.json $SPEED_ARGS \
  ${SPEED_SYSTEMS:+--systems "$SPEED_SYSTEMS"}
[ "${MBU:-0}" = 1 ] && stage mbu deepflash bench speed --device $DEVICE --part mbu --out $R/speed-mbu.json
[ "${MEMORY:-0}" = 1 ] && stage memory deepflash bench memory --device $DEVICE --out $R/memory.json
[ "${RINGS:-0}" = 1 ] && stage rings deepflash bench rings --device $DEVICE --kernels triton --graphs --repeats 100 \
  --out $R/rings.json
echo "CHAIN_DONE"
