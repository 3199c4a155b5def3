"""The thirty-third session's data (unpacked data.tgz): how many raw recall sequences, their prompt lengths, and
the share of their continuations' 6-grams found in the prompt only beyond 4096 and 2048 tokens back."""
import statistics, sys
from deepflash.reach import copied_from_beyond
from pathlib import Path
from deepflash.train.shards import read_all

seqs, _ = read_all(Path(sys.argv[1]))
raw = [s for s in seqs if int(s.tokens[0]) != 1]  # chats open with <|im_start|> (id 1); recall prompts are raw text
starts = [int(s.loss_mask.int().argmax()) for s in raw]
prompts = [s.tokens[:a].tolist() for s, a in zip(raw, starts)]
responses = [s.tokens[a:].tolist() for s, a in zip(raw, starts)]
print(len(seqs), "sequences,", len(raw), "raw recall; prompt tokens median", statistics.median(starts),
      "; longer than 4096:", sum(a > 4096 for a in starts))
for window in (4096, 2048):
    print(f"6-grams only beyond {window}: {copied_from_beyond(prompts, responses, window):.3f}")
print("6-grams in the prompt at all:", round(copied_from_beyond(prompts, responses, 0), 3))
# per sequence: how many copy much from beyond 4096 (the ones a drafter could learn far copying from)
shares = sorted((copied_from_beyond([p], [r], 4096) for p, r in zip(prompts, responses)), reverse=True)
for least in (0.5, 0.2, 0.1, 0.05, 0.01):
    print(f"recall sequences with >= {least:.0%} of 6-grams only beyond 4096: {sum(s >= least for s in shares)}")
