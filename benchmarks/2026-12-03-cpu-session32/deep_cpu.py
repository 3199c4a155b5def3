"""deep_eval's comparison on the real held-out data, on the CPU: the first N held-out sequences whose prompt
passes 4096 tokens, read by the shipped drafter with its whole context and capped at 4096."""
import json, sys, time
import torch
from deepflash.config import EngineConfig
from deepflash.runtime import load_runtime, DEFAULT_DRAFTER
from deepflash.train.trainer import Trainer, TrainConfig

n, only_raw = int(sys.argv[2]), len(sys.argv) > 3
rt = load_runtime(EngineConfig(device="cpu", no_draft=True))
tc = TrainConfig(data=sys.argv[1], out="/tmp/deeprun", init_from=str(DEFAULT_DRAFTER), attention="sdpa",
                 eval_fraction=0.02, steps=1)
trainer = Trainer(tc, rt.target, rt.tokenizer, torch.device("cpu"))
deep = [s for s in trainer.eval_seqs if int(s.loss_mask.int().argmax()) > 4096 and (int(s.tokens[0]) != 1 or not only_raw)][:n]
raw = [int(s.tokens[0]) != 1 for s in deep]  # chats open with <|im_start|> (id 1); recall prompts are raw text
print(len(trainer.eval_seqs), "held out;", len(deep), "deep;", sum(raw), "raw", flush=True)
began = time.time()
rows = []
for seq, is_raw in zip(deep, raw):
    full, capped = trainer.evaluate([seq]), trainer.evaluate([seq], window=4096)
    rows.append({"prompt": int(seq.loss_mask.int().argmax()), "response": int(seq.loss_mask.sum()), "raw": is_raw,
                 "al": full["eval_al"], "al_4096": capped["eval_al"]})
    print(rows[-1], round(time.time() - began), flush=True)
print(json.dumps({"sequences": len(deep), "rows": rows}))
