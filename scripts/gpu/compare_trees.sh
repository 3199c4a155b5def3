#!/usr/bin/env bash
# bench speed on this checkout against another one (OLD: a folder holding that commit's deepflash/ and
# pyproject.toml), in one machine start, rounds interleaved (new, old, new, old): plain and `--spec auto`
# tok/s of the embedded pair and their greedy outputs, compared. Staged as scripts/gpu/README.md says (the
# GGUF joined, `source scripts/gpu/env.sh`); writes $OUT/speed-{new,old}-N.json and $OUT/compare.json.
# The other tree's bench speed must keep each system's outputs in its JSON: for a commit that dropped them,
#   sed -i 's/outputs = r.pop("outputs", None)/outputs = r.get("outputs")/' OLD/deepflash/bench/speed.py
# Usage: bash scripts/gpu/compare_trees.sh OLD [ROUNDS]
set -euo pipefail
old=$(cd "$1" && pwd)
rounds=${2:-2}
new=$PWD
[ -e "$old/deepflash/drafters" ] || ln -s "$new/deepflash/drafters" "$old/deepflash/drafters"
# DEVICE, PROMPTS and MAX_NEW shrink a dry run on the CPU (DEVICE=cpu PROMPTS=1 MAX_NEW=8)
args=(bench speed --device "${DEVICE:-cuda}" --part engines --prompts "${PROMPTS:-5}" --max-new-tokens "${MAX_NEW:-128}"
      --systems "deepflash dflash (spec auto)")
for round in $(seq "$rounds"); do
  for tree in new old; do
    dir=$new; [ $tree = old ] && dir=$old
    (cd "$dir" && PYTHONPATH=$dir:/root/site python3 -m deepflash.cli "${args[@]}" --out "$OUT/speed-$tree-$round.json" \
      | tail -4)
  done
done
python3 - "$rounds" <<'PY'
import json, os, sys

rounds, out = int(sys.argv[1]), os.environ["OUT"]
runs = {tree: [json.load(open(f"{out}/speed-{tree}-{r}.json"))["results"] for r in range(1, rounds + 1)]
        for tree in ("new", "old")}
summary = {}
for system in ("deepflash plain", "deepflash dflash (spec auto)"):
    rates = {tree: [r[system]["decode_tok_per_s"] for r in runs[tree]] for tree in runs}
    walls = {tree: [r[system]["tok_per_s"] for r in runs[tree]] for tree in runs}
    summary[system] = {
        "decode_tok_per_s": rates,
        "new_over_old": sum(rates["new"]) / sum(rates["old"]),
        "tok_per_s_with_prefill": walls,
        "new_over_old_with_prefill": sum(walls["new"]) / sum(walls["old"]),
        "same_outputs": all(a[system]["outputs"] == b[system]["outputs"] for a in runs["new"] for b in runs["old"]),
    }
json.dump(summary, open(f"{out}/compare.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
