# Sourced by chain.sh: the data (carried or generated, plus MORE_DATA), then training, which ends with
# CANDIDATES naming the run's drafters for pick. Uses chain.sh's settings, stage() and $ROOT/shipped-drafter.
CARRIED_DATA=${CARRIED_DATA-$ROOT/stage/data.tgz}
if [ -f "$CARRIED_DATA" ]; then  # token shards made earlier (collect.sh data), carried in parts by stage1.sh
  mkdir -p $DATA && tar xzf "$CARRIED_DATA" -C $DATA && echo "=== $(date +%T) using carried data"
else
  stage datagen deepflash train-drafter generate --device $DEVICE --out $DATA --count $COUNT --max-new-tokens $MAX_NEW $GEN_ARGS
  NEW_DATA=1
fi
# MORE_DATA (generate arguments, e.g. "--count 6000 --exercise-fraction 1 --seed 30") adds shards to the data
if [ -n "${MORE_DATA:-}" ]; then
  stage datagen-more deepflash train-drafter generate --device $DEVICE --out $DATA-more $MORE_DATA
  tag=more-$(date +%s)
  for f in $DATA-more/shard-*.safetensors; do mv "$f" "$DATA/shard-$tag-${f##*/shard-}"; done
  cp $DATA-more/summary.json $R/data-more-summary.json
  NEW_DATA=1
fi
# collect.sh data brings the shards back, so that a later chain can skip datagen
[ -n "${NEW_DATA:-}" ] && tar czf $ROOT/data.tgz -C $DATA . && echo "=== $(date +%T) data packed: $(du -h $ROOT/data.tgz)"
[ "${TRAIN:-1}" = 0 ] && { echo "CHAIN_DONE (TRAIN=0)"; exit 0; }
# training continues from the shipped drafter (--init-from: its architecture, a fresh optimizer and schedule);
# INIT_FROM=/root/stage/arm-a continues a carried drafter, INIT_FROM= (empty) trains LAYERS from scratch
INIT_FROM=${INIT_FROM-$ROOT/shipped-drafter}
train_run() {  # train_run OUT [EXTRA ARGS...]
  deepflash train-drafter train --device $DEVICE --data $DATA --out "$1" --layers $LAYERS --batch-tokens $BATCH_TOKENS \
    --max-minutes $TRAIN_MINUTES --lr $LR --attention ${ATTENTION:-sdpa} --pad-to ${PAD_TO:-256} \
    --workers ${TRAIN_WORKERS:-1} \
    ${INIT_FROM:+--init-from $INIT_FROM} "${@:2}"
}
# TRAIN_B (extra arguments) trains a second arm beside the first on the same GPU; pick then chooses among all
[ -n "${TRAIN_B:-}" ] && { stage train-b train_run $RUN-b $TRAIN_B & }
stage train train_run $RUN $TRAIN_EXTRA
wait
CANDIDATES="$RUN/drafter ${TRAIN_B:+$RUN-b/drafter}"
# a run with --ema also exported its weight average: pick weighs it too
for averaged in $RUN/drafter-ema $RUN-b/drafter-ema; do [ -d $averaged ] && CANDIDATES="$CANDIDATES $averaged"; done
# MORE_CANDIDATES (drafter folders, e.g. the one INIT_FROM named): pick weighs them too
CANDIDATES="$CANDIDATES ${MORE_CANDIDATES:-}"
