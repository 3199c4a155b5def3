"""Walked AL of the shipped drafter on the target's own answers (CPU, float32, greedy, 128 tokens) to
three prompt sets: HumanEval's first 24, 24 'complete' prompts from library functions whose docstrings
carry doctest examples (>>>), and 24 'complete' prompts from functions without."""
import json, random, sys, tempfile
from pathlib import Path
import torch
from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.train.datagen import build_dataset
from deepflash.train.prompts import SHORT_TASKS, Task, _header, functions, site_package_files, stdlib_files
from deepflash.train.trainer import TrainConfig, Trainer

N = int(sys.argv[1]) if len(sys.argv) > 1 else 24
torch.manual_seed(0)
target, tok = embedded_pair("cpu")
rng = random.Random(0)
files = stdlib_files() + site_package_files()
rng.shuffle(files)
doctest, plain = [], []
for p in files:
    if len(doctest) >= N and len(plain) >= N:
        break
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError):
        continue
    fns = functions(text)
    if not fns:
        continue
    header = _header(rng.choice(fns)[1])
    if header is None or len(header) > 3000:
        continue
    group = doctest if ">>>" in header else plain
    if len(group) < N:
        group.append(Task("complete", str(p), [{"role": "user", "content": SHORT_TASKS["complete"].format(header=header)}]))
sets = {"humaneval": [Task("humaneval", "", m) for m in humaneval_messages(N)], "complete with doctests": doctest,
        "complete without doctests": plain}
out = {}
for name, tasks in sets.items():
    with tempfile.TemporaryDirectory() as tmp:
        build_dataset(target, tok, tasks, Path(tmp) / "data", max_new_tokens=128, sampled_fraction=0.0, max_batch=N)
        tc = TrainConfig(data=str(Path(tmp) / "data"), out=str(Path(tmp) / "run"), init_from=str(DEFAULT_DRAFTER),
                         layers=3, eval_fraction=1.0, device="cpu", steps=1)
        trainer = Trainer(tc, target, tok, torch.device("cpu"))
        out[name] = trainer.evaluate()
    print(name, out[name], flush=True)
print(json.dumps(out))
