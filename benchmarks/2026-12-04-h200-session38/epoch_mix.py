"""How an epoch's training steps fall on the carried data (CPU): sequences and tokens by source and length,
and the batches train-drafter train groups them into (--batch-tokens 16384, the 2% held out removed), with
the long ones --long-share would keep. Usage: python epoch_mix.py DATA_FOLDER (the carried data.tgz unpacked)."""

import sys
from collections import Counter

from deepflash.train.shards import (length_batches, long_batches_kept, read_all, read_shard, shard_paths, split_held_out,
                                    split_long)

SOURCES = {"ex38": "thirty-eighth session's exercises", "1796329435": "thirty-fifth session's far recall",
           "1796321233": "thirty-fourth session's mix"}


def band(n: int) -> str:
    return "over 4096" if n > 4096 else ("1025-4096" if n > 1024 else "up to 1024")


sequences, tokens = Counter(), Counter()
for path in shard_paths(sys.argv[1]):
    source = next((name for key, name in SOURCES.items() if key in path.name), "thirty-third session's mix")
    for seq in read_shard(path)[0]:
        sequences[source, band(len(seq))] += 1
        tokens[source, band(len(seq))] += len(seq)
for key in sorted(sequences):
    print(f"{key[0]:38s} {key[1]:>11s}: {sequences[key]:5d} sequences, {tokens[key]:9d} tokens")
_, train = split_held_out(read_all(sys.argv[1])[0], 0.02)
batches = length_batches(train, 16384)
print(f"batches per epoch: {len(batches)}, by their longest sequence: {dict(Counter(band(len(b[-1])) for b in batches))}")
short, long = split_long(batches, 4096)
for share in (0.4, 0.5, 0.6):
    print(f"--long-share {share}: {long_batches_kept(len(short), len(long), share)} of the {len(long)} long batches, "
          f"beside {len(short)} others")
