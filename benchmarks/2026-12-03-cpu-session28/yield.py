"""Yield of usable exercises from train/exercises.py's topics: 48 asks (seed 0), one batch, sampled at 0.8, on the CPU.
Usage: python3 yield.py (prints one JSON line)."""

import json
import time

from deepflash.runtime import EngineConfig, load_runtime
from deepflash.sampling import SamplingParams
from deepflash.train.datagen import generate_batch
from deepflash.train import exercises as ex


if __name__ == "__main__":
    rt = load_runtime(EngineConfig(device="cpu"))
    tok, target = rt.tokenizer, rt.target
    asks = tok.chats(ex.exercise_requests(48, 0))
    began = time.perf_counter()
    replies = generate_batch(target, asks, ex.ANSWER_TOKENS, tok.stop_ids(target.cfg.eos_token_ids),
                             SamplingParams(temperature=0.8, seed=0).validated(), list(range(len(asks))),
                             cuda_graphs=False)
    texts = tok.hf.batch_decode(replies, skip_special_tokens=True)
    headers = [ex.first_header(t) for t in texts]
    topics = [m[0]["content"] for m in ex.exercise_requests(48, 0)]
    print(json.dumps({"asks": len(asks), "usable": sum(h is not None for h in headers),
                      "seconds": round(time.perf_counter() - began, 1),
                      "topics_distinct": len(set(topics)),
                      "examples": [h for h in headers if h][:3]}))
