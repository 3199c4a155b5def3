"""How recall_task's draw spreads in tokens on this machine's site-packages: 200 recall prompts (seed 26),
the opening's length (the continuation's distance back) and the whole prompt, tokenized by the embedded
target's tokenizer. Ends with one JSON line."""
import json
from deepflash.config import EngineConfig
from deepflash.runtime import load_runtime
from deepflash.train.prompts import training_tasks

tasks = training_tasks(200, long_fraction=0.0, seed=26, recall_fraction=1.0, workers=1)
tok = load_runtime(EngineConfig(device="cpu", no_draft=True)).tokenizer
rows = []
for t in tasks:
    cut = t.text.index(t.text[:200], 1)  # where the opening starts again
    rows.append((len(tok.encode(t.text[:cut])), len(tok.encode(t.text))))
n = len(rows)
print(json.dumps({"prompts": n, "opening_beyond_4096": sum(d > 4096 for d, _ in rows) / n,
                  "longer_than_7680": sum(t > 7680 for _, t in rows) / n,
                  "longer_than_8176": sum(t > 8176 for _, t in rows) / n,
                  "opening_tokens_min_max": [min(d for d, _ in rows), max(d for d, _ in rows)]}))
