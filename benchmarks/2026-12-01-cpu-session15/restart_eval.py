"""CPU: the training eval (walked AL on 32 held-out conversations of the fifteenth session's data, split as
its training split them) for the drafter shipped before that session and the one it trained.
Usage: restart_eval.py DATA BEFORE_DRAFTER AFTER_DRAFTER (DATA: the session's data.tgz unpacked; BEFORE:
`git show 7b7c854^:deepflash/drafters/smollm2-135m/{config.json,model.safetensors}`)."""
import json, sys, time
import torch
from deepflash.models import load_target
from deepflash.tokenizer import load_tokenizer
from deepflash.train.trainer import TrainConfig, Trainer

torch.set_num_threads(2)
target, folder = load_target(None, torch.device("cpu"), torch.float32)
tok = load_tokenizer(folder)
out = {}
for name, path in [("before (session 14)", sys.argv[2]), ("after (session 15)", sys.argv[3])]:
    t = time.time()
    tc = TrainConfig(data=sys.argv[1], out="/tmp/d14/run", init_from=path, steps=1, lr=1e-3, attention="sdpa",
                     device="cpu")
    r = Trainer(tc, target, tok, torch.device("cpu")).evaluate()
    out[name] = {"eval_al": r["eval_al"], "eval_loss": round(r["eval_loss"], 4)}
    print(name, out[name], f"{time.time() - t:.0f}s", flush=True)
print(json.dumps(out))
