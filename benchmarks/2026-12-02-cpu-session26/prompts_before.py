"""Host time of the datagen stage before the GPU generates, at 89b55dd (one process, one chat at a
time): the twenty-sixth session's prompts (11,000, seed 18, --function-offset 1) and their tokens."""
import time
t0=time.perf_counter()
from deepflash.train.prompts import training_tasks
from deepflash.tokenizer import load_tokenizer
from deepflash.weights import resolve_model
tasks = training_tasks(11000, 0.3, 18, doctest_fraction=0.1, write_fraction=0.4, function_offset=1)
t1=time.perf_counter()
print("tasks", len(tasks), round(t1-t0,1), flush=True)
tok = load_tokenizer(resolve_model(None))
t2=time.perf_counter()
print("tokenizer load", round(t2-t1,1), flush=True)
n=0
for t in tasks:
    n+=len(tok.chat(t.messages))
t3=time.perf_counter()
print("tokenize", n, round(t3-t2,1), flush=True)
