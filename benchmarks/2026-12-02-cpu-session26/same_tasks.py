"""`python3 same_tasks.py OUT.pkl [WORKERS [COUNT]]`: the tasks of training_tasks(COUNT, 0.3, 18,
doctest_fraction=0.1, write_fraction=0.4, function_offset=1) pickled to OUT.pkl, with their time; run
under PYTHONPATH=<a checkout> to compare two versions (the doctest and write shares compared equal
between 89b55dd and the worker processes at 3000 tasks; the drawn ones differ by design)."""
import pickle, sys, time
from deepflash.train import prompts
print(prompts.__file__)
if __name__ == '__main__':
    kw = dict(doctest_fraction=0.1, write_fraction=0.4, function_offset=1)
    if len(sys.argv) > 2: kw["workers"] = int(sys.argv[2])
    t = time.perf_counter()
    tasks = prompts.training_tasks(int(sys.argv[3]) if len(sys.argv) > 3 else 3000, 0.3, 18, **kw)
    print(len(tasks), round(time.perf_counter() - t, 1))
    pickle.dump(tasks, open(sys.argv[1], "wb"))
