"""How far back the drafter looks: training's deep_eval sequences (the held-out ones whose response copies most
from beyond 4096 tokens back) read with the drafter's whole context and with every layer's window capped at
4096, 2048, 1024 and 256, on the CPU. Usage: reach_cpu.py DATA DRAFTER [DRAFTER...]; one JSON line each, with
the AL of all sequences together (their walked tokens over their steps, as deep_eval reads them)."""
import json, sys, time
import torch
from deepflash.config import EngineConfig
from deepflash.reach import copied_from_beyond
from deepflash.runtime import load_runtime
from deepflash.train.trainer import DEEP_WINDOW, Trainer, TrainConfig

WINDOWS = (None, 4096, 2048, 1024, 256)
rt = load_runtime(EngineConfig(device="cpu", no_draft=True))


def cache_target_pass(trainer):
    """The frozen target's features of one sequence, computed once for all the windows (they do not depend on it)."""
    compute, kept = trainer._target_pass, {}

    def cached(tokens, final=False):
        key = hash(tokens.numpy().tobytes())
        if key not in kept:
            kept.clear()
            kept[key] = compute(tokens, final=final)
        return kept[key]
    trainer._target_pass = cached


for drafter in sys.argv[2:]:
    tc = TrainConfig(data=sys.argv[1], out="/tmp/reachrun", init_from=drafter, attention="sdpa", steps=1)
    trainer = Trainer(tc, rt.target, rt.tokenizer, torch.device("cpu"))
    cache_target_pass(trainer)
    deep = trainer._copying_from_beyond(DEEP_WINDOW)
    began, rows = time.time(), []
    for seq in deep:
        start = int(seq.loss_mask.int().argmax())
        ids = seq.tokens.tolist()
        row = {"prompt": start, "response": int(seq.loss_mask.sum()),
               "copied_beyond": {w: round(copied_from_beyond([ids[:start]], [ids[start:]], w), 3) for w in WINDOWS[1:]}}
        row["al"] = {str(w): trainer.evaluate([seq], window=w)["eval_al"] for w in WINDOWS}
        rows.append(row)
        print(row, round(time.time() - began), flush=True)
    steps = {str(w): sum(r["response"] / r["al"][str(w)] for r in rows) for w in WINDOWS}
    total = {w: round(sum(r["response"] for r in rows) / s, 3) for w, s in steps.items()}
    print(json.dumps({"drafter": drafter, "sequences": len(deep), "al": total, "rows": rows}), flush=True)
