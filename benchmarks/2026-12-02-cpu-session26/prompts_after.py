"""The same with the prompts built in one process per CPU (workers=0) and the chats tokenized in one
batched call (Tokenizer.chats)."""
import time
from deepflash.train.prompts import training_tasks
from deepflash.tokenizer import load_tokenizer
from deepflash.weights import resolve_model
if __name__ == "__main__":
    t0 = time.perf_counter()
    tasks = training_tasks(11000, 0.3, 18, doctest_fraction=0.1, write_fraction=0.4, function_offset=1, workers=0)
    t1 = time.perf_counter()
    print("tasks", len(tasks), round(t1 - t0, 1), flush=True)
    tok = load_tokenizer(resolve_model(None))
    t2 = time.perf_counter()
    ids = tok.chats([t.messages for t in tasks])
    t3 = time.perf_counter()
    print("tokenize batched", sum(map(len, ids)), round(t3 - t2, 1), flush=True)
