"""CPU: does continuing the shipped drafter at lr 1e-3 (a fresh AdamW, warmup then cosine) first lower its
walked eval AL, and does 3e-4 lower it less? 60 steps of 2048 tokens from the shipped drafter on the
fifteenth session's data, evaluated at steps 0, 30 and 60 on 8 held-out conversations. Both arms draw the
same batches (seed 0). Usage: lr_dip.py DATA DRAFTER LR [LR ...]; each run's log is its train.jsonl.
On this CPU a step took ~30 s, so both runs were stopped after their step-30 evaluation."""
import json, sys, time
import torch
from deepflash.models import load_target
from deepflash.tokenizer import load_tokenizer
from deepflash.train.trainer import TrainConfig, Trainer

torch.set_num_threads(2)
target, folder = load_target(None, torch.device("cpu"), torch.float32)
tok = load_tokenizer(folder)
out = {}
for lr in map(float, sys.argv[3:]):
    t = time.time()
    tc = TrainConfig(data=sys.argv[1], out=f"/tmp/lr/run-{lr}", init_from=sys.argv[2], steps=60, lr=lr,
                     batch_tokens=2048, eval_every=30, ckpt_every=10**9, eval_fraction=0.00045, attention="sdpa",
                     device="cpu", log_every=10)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    trainer.run()
    out[str(lr)] = [(r["step"], r["eval_al"], round(r["eval_loss"], 4)) for r in trainer.progress.history]
    print(lr, out[str(lr)], f"{time.time() - t:.0f}s", flush=True)
print(json.dumps(out))
