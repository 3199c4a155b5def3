"""Time datagen's tokenize step in its two parts (rendering the chat templates, the batched encode) for
4000 prompts of the data's settings (--seed 19 --function-offset 2; built once, cached in /tmp/tokbench).
Usage: python3 tokenize_threads.py, then TOKENIZERS_PARALLELISM=false python3 tokenize_threads.py
(one line of JSON each)."""
import json
import os
import pickle
import time
from pathlib import Path

if __name__ == "__main__":
    cache = Path("/tmp/tokbench/tasks.pkl")
    cache.parent.mkdir(exist_ok=True)
    if not cache.exists():
        from deepflash.train.prompts import training_tasks
        tasks = training_tasks(4000, 0.3, 19, doctest_fraction=0.1, write_fraction=0.4, function_offset=2, workers=2)
        cache.write_bytes(pickle.dumps([t.messages for t in tasks]))
    convs = pickle.loads(cache.read_bytes())
    from deepflash.models import resolve_model
    from deepflash.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    t0 = time.perf_counter()
    texts = [tok.hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in convs]
    t1 = time.perf_counter()
    ids = tok.hf(texts, add_special_tokens=False)["input_ids"]
    t2 = time.perf_counter()
    print(json.dumps({"parallelism": os.environ.get("TOKENIZERS_PARALLELISM"), "prompts": len(convs),
                      "tokens": sum(map(len, ids)), "render_s": round(t1 - t0, 2), "encode_s": round(t2 - t1, 2)}))
