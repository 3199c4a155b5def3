#!/usr/bin/env bash
# The GPU session in one detached chain (started by start.sh); each stage
# logs to $ROOT/results/<stage>.log and a failed stage does not stop the ones after it (except
# training, which the benchmarks need). Between stages the chain switches to code that a later run
# left in $ROOT/next (wait.sh), so fixes made while it trains reach the benchmarks.
# Sizes come from the environment so that a CPU dry run (scripts/gpu/dryrun.sh) runs the same chain.
set -uo pipefail
source scripts/gpu/env.sh
ROOT=${ROOT:-/root}
DEVICE=${DEVICE:-cuda}
COUNT=${COUNT:-2500}
MAX_NEW=${MAX_NEW:-320}
GEN_ARGS=${GEN_ARGS:-}  # more generate arguments for the datagen stage, e.g. "--seed 6 --long-fraction 0.3"
TRAIN_MINUTES=${TRAIN_MINUTES:-11}
LR=${LR:-2e-3}  # width-576 drafter: SmolLM2-135M itself was pretrained at 3e-3; the recipe's 6e-4 is for 4096-wide ones
LAYERS=${LAYERS:-2}
BATCH_TOKENS=${BATCH_TOKENS:-16384}  # the step time hardly grows with it (profile_train.py)
PICK_PROMPTS=${PICK_PROMPTS:-24}
ACCEPT_ARGS=${ACCEPT_ARGS:---per-depth 2 --max-new-tokens 128}
SPEED_ARGS=${SPEED_ARGS:---prompts 5 --max-new-tokens 128}
MBU=${MBU:-0}  # 1 adds the Qwen3-8B-shaped run
SMOKE_ARGS=${SMOKE_ARGS:---prompts 3 --max-new-tokens 64}
PROFILE_ARGS=${PROFILE_ARGS:-}  # e.g. --attention-sweep 32,16,64
R=$ROOT/results
DATA=$ROOT/data
RUN=$ROOT/run
mkdir -p "$R"
refresh() {  # take the code a keep-alive run carried, keeping the drafter the chain picked
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

# MORE_DATA_GPU1 (generate arguments) answers more prompts on a second GPU while the first one
# measures; its shards join the data before training
if [ -n "${MORE_DATA_GPU1:-}" ]; then
  echo "=== $(date +%T) datagen-gpu1: start (background)"
  ( CUDA_VISIBLE_DEVICES=1 deepflash train-drafter generate --device $DEVICE --out $DATA-gpu1 $MORE_DATA_GPU1 \
      > "$R/datagen-gpu1.log" 2>&1; echo "=== $(date +%T) datagen-gpu1: rc=$?" ) &
  GPU1_DATA=$!
fi

# measurements that need a quiet GPU first; each is switched on by its variable (1 = run)
if [ "$DEVICE" = cuda ]; then
  [ "${PROFILE:-0}" = 1 ] && stage profile python3 scripts/gpu/profile_step.py --out $R/profile.json $PROFILE_ARGS
  [ "${FLA:-0}" = 1 ] && stage fla python3 -m pytest -q -rs tests/test_qwen3_5.py -k fla
  if [ "${PROFILE_TRAIN:-1}" = 1 ]; then
    stage flex_test python3 -m pytest -q -rs tests/test_training.py -k flex && FLEX_OK=1
    stage profile_train python3 scripts/gpu/profile_train.py --out $R/profile-train.json
  fi
  [ "${MEM_PEAK:-1}" = 1 ] && stage mem_peak python3 scripts/gpu/mem_peak.py --out $R/mem-peak.json
  if [ "${RINGS:-1}" = 1 ]; then  # the benchmark runs even if a test fails (its log says which)
    stage kernels python3 -m pytest -q -rs tests/test_ring_kernels.py tests/test_target_kernels.py
    stage rings deepflash bench rings --device $DEVICE --kernels ${RING_KERNELS:-torch,compile,triton} --out $R/rings.json \
      --triton-shapes ${RING_SHAPES:-8x1,16x1,16x4,32x1,32x4,32x8,64x4,64x8,16x1x8x2,16x1x8x3,32x1x4x3,32x4x8x3}
  fi
fi
[ "${SMOKE:-0}" = 1 ] && stage smoke python3 scripts/gpu/smoke.py --device $DEVICE --out $R/smoke.json $SMOKE_ARGS
# training continues from the shipped drafter (train_chain.sh), and pick weighs every candidate against it
rm -rf $ROOT/shipped-drafter && cp -r deepflash/drafters/smollm2-135m $ROOT/shipped-drafter
# CANDIDATES (drafter folders): no data and no training, pick among them and the shipped drafter, then
# measure; e.g. the arms collect.sh brought back from a machine that went back before pick, carried as
# .stage/arm-a and .stage/arm-b (CANDIDATES="/root/stage/arm-a /root/stage/arm-b"). CANDIDATES=none: no pick
# either, only the measurements of the drafter in the working tree (one a machine that went back after pick
# had chosen, unpacked there from collect.sh's drafter.part*)
if [ "${CANDIDATES:-}" = none ]; then
  echo "=== $(date +%T) candidates: none, measuring the working tree's drafter"
elif [ -n "${CANDIDATES:-}" ]; then
  echo "=== $(date +%T) candidates: $CANDIDATES"
else
  source scripts/gpu/train_chain.sh
fi
# ship the new drafter only if it beats the shipped one per byte
[ "${CANDIDATES:-}" = none ] || stage pick python3 scripts/gpu/pick_drafter.py $CANDIDATES $ROOT/shipped-drafter \
  --device $DEVICE --prompts $PICK_PROMPTS --into deepflash/drafters/smollm2-135m --out $R/pick.json \
  || { echo "CHAIN_FAILED: no drafter"; exit 1; }
# SWEEP_ARGS (bench accept arguments): each drafter of SWEEP_DRAFTERS (default: the arm's weight average and the
# shipped drafter) on the same prompts, whichever pick shipped, in accept-NAME.json (NAME: its path under $ROOT,
# / as -), so that drafters and windows compare prompt by prompt (bench.accept.paired_change)
for drafter in ${SWEEP_ARGS:+${SWEEP_DRAFTERS:-$RUN/drafter-ema $ROOT/shipped-drafter}}; do
  name=${drafter#$ROOT/} && name=${name//\//-}
  stage sweep-$name deepflash bench accept --device $DEVICE --draft $drafter --out $R/accept-$name.json $SWEEP_ARGS
done
stage accept deepflash bench accept --device $DEVICE --out $R/accept.json --plot $R/accept.png $ACCEPT_ARGS
stage speed deepflash bench speed --device $DEVICE --part engines --out $R/speed.json $SPEED_ARGS \
  ${SPEED_SYSTEMS:+--systems "$SPEED_SYSTEMS"}
# STEP_TIMES=1: per step kind, the host's launch time and the time the engine records (scripts/gpu/step_times.py)
[ "${STEP_TIMES:-0}" = 1 ] && stage step_times python3 scripts/gpu/step_times.py --device $DEVICE --out $R/step-times.json
[ "${MEMORY:-0}" = 1 ] && stage memory deepflash bench memory --device $DEVICE --out $R/memory.json
[ "$MBU" = 1 ] && stage mbu deepflash bench speed --device $DEVICE --part mbu --out $R/speed-mbu.json
# scripts/gpu/extra.sh, if a keep-alive run carried one, runs last (e.g. a kernel made while the chain trained)
[ -f scripts/gpu/extra.sh ] && stage extra bash scripts/gpu/extra.sh "$R"
echo "CHAIN_DONE"
