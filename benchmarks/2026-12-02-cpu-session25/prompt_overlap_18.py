import json, pickle
from deepflash.train.prompts import training_tasks
key = lambda t: json.dumps(t.messages)
same = [(t.kind, t.source, t.messages) for t in training_tasks(8000, 0.3, 17, doctest_fraction=0.1, write_fraction=0.4)]
print("offset 0 reproduces seed 17:", same == pickle.load(open("/tmp/tasks_before.pkl", "rb")), flush=True)
old = {key(t) for t in training_tasks(6000, 0.3, 13, doctest_fraction=0.1, write_fraction=0.4)}
for seed in (14, 15, 16, 17):
    old |= {key(t) for t in training_tasks(8000 if seed == 17 else 4000, 0.3, seed, doctest_fraction=0.1, write_fraction=0.4)}
for offset in (0, 1):
    kinds = {}
    for t in training_tasks(12000, 0.3, 18, doctest_fraction=0.1, write_fraction=0.4, function_offset=offset):
        k = kinds.setdefault(t.kind, [0, 0]); k[0] += 1; k[1] += key(t) in old
    print(json.dumps({"seed": 18, "function_offset": offset, "prompts": sum(v[0] for v in kinds.values()),
                      "also drawn by seeds 13-17": sum(v[1] for v in kinds.values()),
                      "write": kinds["write"], "complete_doctest": kinds["complete_doctest"]}), flush=True)
