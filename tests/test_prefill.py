"""The prefill in pieces: power-of-two pieces, overlapping where a prompt's rest is not one, leave the
KV cache, the feature rings and the first token as one forward over the whole prompt does."""

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.graphs import prefill_pieces
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError

TOKENIZER = tiny_tokenizer()
TARGET = tiny_target()


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_pieces_cover_every_prompt_in_order_in_power_of_two_sizes(chunk):
    for n in range(1, 300):
        pieces = prefill_pieces(n, chunk)
        done = 0
        for lo, size in pieces:
            assert 0 <= lo <= done, (n, pieces)  # every position before a piece is done when it runs
            assert size <= chunk and size & (size - 1) == 0, (n, pieces)
            done = max(done, lo + size)
        assert done == n and pieces[-1][0] + pieces[-1][1] == n
        assert len(pieces) <= n // chunk + 2


def test_pieces_of_the_benchmark_prompts():
    assert prefill_pieces(170, 1024) == [(0, 128), (106, 64)]
    assert prefill_pieces(128, 1024) == [(0, 128)]
    assert prefill_pieces(2048, 1024) == [(0, 1024), (1024, 1024)]
    assert prefill_pieces(5849, 1024)[-2:] == [(4096, 1024), (4825, 1024)]


@pytest.mark.parametrize("n", [1, 5, 8, 13, 21, 40])
def test_pieces_leave_what_one_forward_leaves(n):
    drafter = tiny_drafter(drafter_config(TARGET.cfg))
    engine = Engine(TARGET, TOKENIZER, drafter, config=EngineConfig(spec="on", prefill_chunk=8))
    ids = torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    engine.complete(ids, SamplingParams(max_new_tokens=1))  # the prefill alone: no decode step runs

    cache = TARGET.new_cache(1, engine.max_ctx)
    logits, feats = TARGET(torch.tensor([ids]), torch.arange(n), cache, n, capture=drafter.cfg.target_layer_ids,
                           logits="last")
    for mine, ref in ((engine.cache.k, cache.k), (engine.cache.v, cache.v)):
        torch.testing.assert_close(mine[..., :n, :], ref[..., :n, :])
    torch.testing.assert_close(engine.steps.features.ring.read(0, n, torch.float64), feats[0])
    assert int(engine.state.last) == int(logits[0, -1].argmax()) and int(engine.state.start) == n


def test_prefill_chunk_must_be_a_power_of_two():
    with pytest.raises(UserError, match="power of two"):
        Engine(TARGET, TOKENIZER, config=EngineConfig(prefill_chunk=1000))


def test_default_prefill_chunk_is_halved_until_the_plan_fits_the_device(monkeypatch):
    """No --prefill-chunk: on CUDA the default is halved while the memory plan exceeds the free memory (a
    smaller chunk, smaller prefill activations); a chunk the user gives, and the CPU, keep theirs."""
    from types import SimpleNamespace

    from deepflash.engine import runtime

    monkeypatch.setattr(runtime, "free_device_bytes", lambda device: 10_000 + 2**30)  # 10,000 over the reserve
    monkeypatch.setattr(runtime, "plan_memory",
                        lambda target, drafter, ctx, config, device: SimpleNamespace(total=40 * config.chunk))
    cuda = torch.device("cuda")
    assert runtime.fit_prefill_chunk(EngineConfig(max_ctx=64), TARGET, None, cuda) == 128  # 40 x 128 < 10,000
    assert runtime.fit_prefill_chunk(EngineConfig(max_ctx=64, prefill_chunk=1024), TARGET, None, cuda) == 1024
    assert runtime.fit_prefill_chunk(EngineConfig(max_ctx=64), TARGET, None, torch.device("cpu")) == 1024
    monkeypatch.setattr(runtime, "free_device_bytes", lambda device: 2**30)  # nothing fits: the smallest
    assert runtime.fit_prefill_chunk(EngineConfig(max_ctx=64), TARGET, None, cuda) == 64
