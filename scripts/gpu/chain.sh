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
CARRIED_DATA=${CARRIED_DATA-$ROOT/stage/data.tgz}
if [ -f "$CARRIED_DATA" ]; then  # token shards brought back by an earlier session (collect.sh)
  mkdir -p $DATA && tar xzf "$CARRIED_DATA" -C $DATA && echo "=== $(date +%T) using carried data"
else
  stage datagen deepflash train-drafter generate --device $DEVICE --out $DATA --count $COUNT --max-new-tokens $MAX_NEW $GEN_ARGS
  NEW_DATA=1
fi
# MORE_DATA (generate arguments, e.g. "--count 6000 --seed 1") adds shards to the carried or new data
adopt() {  # adopt FOLDER NAME [INTO]: move a generate run's shards into the data (or INTO), under new names
  local tag=$2-$(date +%s) into=${3:-$DATA}
  mkdir -p "$into"
  for f in $1/shard-*.safetensors; do mv "$f" "$into/shard-$tag-${f##*/shard-}"; done
  cp $1/summary.json $R/data-$2-summary.json
  NEW_DATA=1
}
if [ -n "${MORE_DATA:-}" ]; then
  stage datagen-more deepflash train-drafter generate --device $DEVICE --out $DATA-more $MORE_DATA
  adopt $DATA-more more
fi
if [ -n "${GPU1_DATA:-}" ]; then
  wait $GPU1_DATA
  tail -n 2 "$R/datagen-gpu1.log"
  adopt $DATA-gpu1 gpu1
fi
# ARM_A_DATA, ARM_B_DATA (generate arguments, e.g. "--count 3000 --exercise-fraction 1 --seed 20"): shards that
# one arm alone trains on beside the shared ones, kept in the data's arm-a/ or arm-b/ (an A/B of data)
declare -A ARM_DATA=([a]=$DATA [b]=$DATA)
for arm in a b; do
  args=ARM_${arm^^}_DATA
  [ -n "${!args:-}" ] || continue
  stage datagen-$arm deepflash train-drafter generate --device $DEVICE --out $DATA-$arm-new ${!args}
  adopt $DATA-$arm-new arm-$arm $DATA/arm-$arm  # beside any carried in arm-$arm/
  ARM_DATA[$arm]=$DATA-$arm && rm -rf $DATA-$arm && mkdir -p $DATA-$arm
  ln -s $DATA/shard-*.safetensors $DATA/arm-$arm/shard-*.safetensors $DATA-$arm/
done
# collect.sh brings the shards back (an arm's own in arm-a/, arm-b/), so later sessions can skip datagen
[ -n "${NEW_DATA:-}" ] && tar czf $ROOT/data.tgz -C $DATA . && echo "=== $(date +%T) data packed: $(du -h $ROOT/data.tgz)"
[ "${TRAIN:-1}" = 0 ] && { echo "CHAIN_DONE (TRAIN=0)"; exit 0; }
# training continues from the shipped drafter (--init-from: its architecture, fresh optimizer), so that
# it accumulates over sessions; INIT_FROM= (empty) trains LAYERS from scratch.
# scripts/gpu/train.env, if a keep-alive run carried one, overrides the training settings.
rm -rf $ROOT/shipped-drafter && cp -r deepflash/drafters/smollm2-135m $ROOT/shipped-drafter
INIT_FROM=${INIT_FROM-$ROOT/shipped-drafter}
refresh
[ -f scripts/gpu/train.env ] && source scripts/gpu/train.env && echo "=== train.env: $(cat scripts/gpu/train.env | tr '\n' ' ')"
# ATTENTION=best: flex_attention if its test passed and profile_train.py timed its steps 10% faster
# (median) than SDPA's query chunks, else sdpa
if [ "${ATTENTION:-sdpa}" = best ]; then
  ATTENTION=$(FLEX_OK=${FLEX_OK:-0} python3 - "$R/profile-train.json" <<'PY'
import json, os, sys
try:
    runs = {r["attention"]: r for r in json.load(open(sys.argv[1]))["runs"] if "error" not in r}
    faster = runs["flex"]["median_s_per_step"] < 0.9 * runs["sdpa"]["median_s_per_step"]
except (OSError, KeyError, ValueError):
    faster = False
print("flex" if faster and os.environ["FLEX_OK"] == "1" else "sdpa")
PY
)
  echo "=== attention for training: $ATTENTION"
fi
# --pad-to: every new batch shape costs host time (BENCHMARKS.md, third session); PAD_TO=0 turns it off
train_run() {  # train_run OUT DATA [EXTRA ARGS...]
  deepflash train-drafter train --device $DEVICE --data "$2" --out "$1" --layers $LAYERS --batch-tokens $BATCH_TOKENS \
    --max-minutes $TRAIN_MINUTES --lr $LR --attention ${ATTENTION:-sdpa} --pad-to ${PAD_TO:-256} \
    --workers ${TRAIN_WORKERS:-1} \
    ${INIT_FROM:+--init-from $INIT_FROM} "${@:3}"
}
# TRAIN_B (extra arguments) trains a second arm side by side for an A/B; pick then chooses among all
[ -n "${TRAIN_B:-}" ] && { stage train-b train_run $RUN-b ${ARM_DATA[b]} $TRAIN_B & }
stage train train_run $RUN ${ARM_DATA[a]} ${TRAIN_EXTRA:-}
wait
# ship the new drafter only if it beats the shipped one per byte
stage pick python3 scripts/gpu/pick_drafter.py $RUN/drafter ${TRAIN_B:+$RUN-b/drafter} $ROOT/shipped-drafter --device $DEVICE \
  --prompts $PICK_PROMPTS --into deepflash/drafters/smollm2-135m --out $R/pick.json \
  || { echo "CHAIN_FAILED: no drafter"; exit 1; }
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
