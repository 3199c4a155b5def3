"""Share of seed 17's 8000 prompts (the 25th session's datagen) that seeds 13-16 (4000 each at 13 and 14
with the settings then, here all with the same fractions) also drew, on this machine's site-packages."""
import json
from deepflash.train.prompts import training_tasks
key = lambda t: json.dumps(t.messages)
new = [key(t) for t in training_tasks(8000, 0.3, 17, doctest_fraction=0.1, write_fraction=0.4)]
old = set()
for seed in (13, 14, 15, 16):
    old |= {key(t) for t in training_tasks(4000 if seed > 13 else 6000, 0.3, seed, doctest_fraction=0.1, write_fraction=0.4)}
kinds = {}
for t in training_tasks(8000, 0.3, 17, doctest_fraction=0.1, write_fraction=0.4):
    k = kinds.setdefault(t.kind, [0, 0]); k[0] += 1; k[1] += key(t) in old
print(json.dumps({"seed 17 prompts": len(new), "also drawn by seeds 13-16": sum(k in old for k in new), "by kind": kinds}))
