"""Which raw recall prompts made the target copy from far back (the thirty-third session's data, unpacked):
each prompt is a module's opening then a prefix of it again (recall_task); the prompt's last tokens found in
the first copy mark the repeat's end there (less the last few: the prompt's closing newline tokenizes
alone, the same newline in the first copy with what follows it), and the continuation's
source lies the opening's length back. Share of the continuation's 6-grams
found in the prompt only beyond 4096 tokens back, only in the first copy (not in the repeat: the source), and
in the prompt at all, by opening and by repeat share."""
import sys
from pathlib import Path
from deepflash.reach import copied_from_beyond
from deepflash.train.shards import read_all

seqs, _ = read_all(Path(sys.argv[1]))
rows = []
for s in seqs:
    if int(s.tokens[0]) == 1:  # chats open with <|im_start|>; recall prompts are raw text
        continue
    start = int(s.loss_mask.int().argmax())
    ids, out = s.tokens[:start].tolist(), s.tokens[start:].tolist()
    tail = ids[-40:-8]
    repeat = next((p + 40 for p in range(start - 80) if ids[p:p + 32] == tail), 0)
    if not repeat:  # a prompt cut inside its opening (datagen keeps a too-long prompt's first tokens)
        continue
    rows.append((start - repeat, repeat, copied_from_beyond([ids], [out], 4096), copied_from_beyond([ids], [out], 0),
                 copied_from_beyond([ids], [out], repeat)))
print(len(rows), "recall sequences with their repeat found")
for lo, hi in ((0, 3000), (3000, 4096), (4096, 4600), (4600, 5500), (5500, 9000)):
    for rlo, rhi in ((0, 0.4), (0.4, 0.7), (0.7, 1.01)):
        part = [r for r in rows if lo <= r[0] < hi and rlo <= r[1] / r[0] < rhi]
        if part:
            print(f"opening {lo}-{hi}, repeat/opening {rlo}-{rhi}: {len(part):4d} sequences, "
                  f"from beyond 4096 {sum(r[2] for r in part) / len(part):.3f}, from the first copy only "
                  f"{sum(r[4] for r in part) / len(part):.3f}, in the prompt {sum(r[3] for r in part) / len(part):.3f}")
