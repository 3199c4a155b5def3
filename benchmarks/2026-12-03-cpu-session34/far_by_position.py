"""Where in a recall continuation the target copies from beyond 4096 tokens: for the recall sequences of the
data in DIR (unpacked data.tgz, raw prompts: they do not open with <|im_start|>) whose prompts exceed 5000
tokens, the share of the response's 6-grams found only beyond 4096 tokens back (the prompt and the response
so far), per stretch of response tokens. Usage: far_by_position.py DIR."""
import sys
from pathlib import Path
from deepflash.reach import copied_from_beyond
from deepflash.train.shards import read_all

seqs, _ = read_all(Path(sys.argv[1]))
raw = [s for s in seqs if int(s.tokens[0]) != 1]
starts = [int(s.loss_mask.int().argmax()) for s in raw]
far = [(s.tokens[:a].tolist(), s.tokens[a:].tolist()) for s, a in zip(raw, starts) if a > 5000]
print(len(far), "recall sequences with prompts over 5000 tokens")
for lo, hi in ((0, 64), (64, 128), (128, 256), (256, 512)):
    before = [p + r[:lo] for p, r in far]
    stretch = [r[lo:hi] for _, r in far]
    print(f"response tokens {lo}-{hi}: only beyond 4096 {copied_from_beyond(before, stretch, 4096):.3f}, "
          f"in the prompt {copied_from_beyond(before, stretch, 0):.3f}")
