# Sourced by chain.sh: the data (carried, generated, more, the arms' own), then training, which ends with
# CANDIDATES naming the arms' drafters for pick. Uses chain.sh's settings, stage() and $ROOT/shipped-drafter.
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
# DATA_SHARDS (a glob of shard names, e.g. "shard-more-1796329435-*"): arm a trains on those shards of the data
# alone (an arm on one session's data, undiluted by the rest); the data itself stays whole
if [ -n "${DATA_SHARDS:-}" ]; then
  ls $DATA/$DATA_SHARDS >/dev/null 2>&1 || { echo "CHAIN_FAILED: no shard in $DATA matches $DATA_SHARDS"; exit 1; }
  rm -rf $DATA-only && mkdir -p $DATA-only && ln -s $DATA/$DATA_SHARDS $DATA-only/
  ARM_DATA[a]=$DATA-only
  echo "=== $(date +%T) arm a trains on $(ls $DATA-only | wc -l) shards ($DATA_SHARDS)"
fi
# collect.sh brings the shards back (an arm's own in arm-a/, arm-b/), so later sessions can skip datagen
[ -n "${NEW_DATA:-}" ] && tar czf $ROOT/data.tgz -C $DATA . && echo "=== $(date +%T) data packed: $(du -h $ROOT/data.tgz)"
[ "${TRAIN:-1}" = 0 ] && { echo "CHAIN_DONE (TRAIN=0)"; exit 0; }
# training continues from the shipped drafter (--init-from: its architecture, fresh optimizer), so that
# it accumulates over sessions; INIT_FROM= (empty) trains LAYERS from scratch.
# scripts/gpu/train.env, if a keep-alive run carried one, overrides the training settings.
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
CANDIDATES="$RUN/drafter ${TRAIN_B:+$RUN-b/drafter}"
# an arm trained with --ema (TRAIN_EXTRA, TRAIN_B) also exported its weight average: pick weighs it too
for averaged in $RUN/drafter-ema $RUN-b/drafter-ema; do [ -d $averaged ] && CANDIDATES="$CANDIDATES $averaged"; done
# MORE_CANDIDATES (drafter folders, e.g. the arm this one continued from with INIT_FROM): pick weighs them too
CANDIDATES="$CANDIDATES ${MORE_CANDIDATES:-}"
