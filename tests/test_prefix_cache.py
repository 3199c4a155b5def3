"""The prefix cache: the index (hits, partial hits, misses, restores on the grid, LRU eviction within budgets,
host tier), and the engine with it: outputs never depend on it (llama-family and hybrid targets, greedy and
sampled, interleaved conversations, a small budget, a hit inside a hybrid snapshot interval, a cancelled partly
cached prefill), and after a hit the drafter sees exactly the context it sees without the cache."""

from __future__ import annotations

import pytest
import torch
from helpers import drafter_config, hybrid_target, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.engine import steps as steps_module
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Cancelled, Engine
from deepflash.engine.memory import plan_memory
from deepflash.engine.prefix_cache import ROOT, Block, PrefixCache
from deepflash.engine.prefix_reuse import chain_keys
from deepflash.engine.sampling import SamplingParams

TOKENIZER = tiny_tokenizer()
LLAMA = tiny_target()
HYBRID = hybrid_target("dense")
BLOCK, CHUNK = 8, 16


# --- the index ----------------------------------------------------------------------------------------
def fake_block(tokens: list[int], i: int, nbytes: int = 64, state: bool = False, features: bool = True) -> Block:
    """Full block i of `tokens` (blocks of BLOCK) with `nbytes` of fake KV."""
    keys = chain_keys(tokens, BLOCK)
    lo = i * BLOCK
    return Block(keys[i], keys[i - 1] if i else ROOT, lo, tuple(tokens[lo : lo + BLOCK]),
                 (torch.zeros(nbytes // 8, dtype=torch.float64),), torch.zeros(1, 0) if features else None,
                 (torch.zeros(0),) if state else None)


def fill(index: PrefixCache, tokens: list[int], **kw) -> None:
    for i in range(len(tokens) // BLOCK):
        index.insert(fake_block(tokens, i, **kw))


def conversation(seed: int, n: int) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hit_partial_hit_and_miss():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=False, window=None)
    tokens = conversation(0, 32)  # 4 blocks
    fill(index, tokens)
    assert index.lookup(tokens, 31).length == 24  # all but the last token: the block ends up to 31
    assert index.lookup(tokens + [5, 6], 33).length == 32
    assert index.lookup(tokens[:20] + [1, 2, 3], 22).length == 16  # diverges inside block 2
    assert index.lookup(tokens[:3] + [1] + tokens[4:], 31).length == 0
    assert index.lookup([tokens[0] + 1] + tokens[1:], 31).length == 0
    hit = index.lookup(tokens[:20] + [1], 20)
    assert [b.start for b in hit.blocks] == [0, 8] and hit.length == 16


def test_restores_end_on_the_grid():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=False, window=None, grid=2 * BLOCK)
    tokens = conversation(0, 32)
    fill(index, tokens)
    assert index.lookup(tokens + [5], 32).length == 32
    assert index.lookup(tokens, 31).length == 16  # 24 is a block end, not a grid point


def test_hybrid_targets_resume_only_where_states_were_taken():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=True, window=None)
    tokens = conversation(0, 32)
    for i in range(4):  # states at the end of blocks 1 (16) and 3 (32)
        index.insert(fake_block(tokens, i, state=i in (1, 3)))
    assert index.lookup(tokens + [7], 32).length == 32
    assert index.lookup(tokens[:29] + [7], 29).length == 16  # block 3 is not all matched: back to 16
    assert index.lookup(tokens[:15], 14).length == 0


def test_a_restore_needs_the_features_of_its_window():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=False, window=10)
    tokens = conversation(0, 32)
    for i in range(4):
        index.insert(fake_block(tokens, i, features=i != 2))  # block 2 (16..23) without features
    assert index.lookup(tokens + [5], 32).length == 16  # 32 needs 22..31; 16 needs 6..15
    assert index.lookup(tokens[:12] + [5], 12).length == 8


def test_interleaved_conversations_all_hit():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=False, window=None)
    talks = [conversation(seed, 40) for seed in range(3)]
    for turn in range(3):
        for talk in talks:
            prompt = talk[: 16 + 8 * turn]
            assert index.lookup(prompt, len(prompt) - 1).length == (16 + 8 * (turn - 1) if turn else 0)
            fill(index, prompt)


def test_eviction_keeps_the_budget_and_drops_the_deepest_least_recent_blocks_first():
    index = PrefixCache(BLOCK, 6 * 64, 0, needs_state=False, window=None)
    old, new = conversation(0, 32), conversation(1, 32)
    fill(index, old)
    fill(index, new)  # 8 blocks of 64 bytes into a budget of 6
    assert index.device_bytes <= 6 * 64 and index.stats.evictions == 2
    assert index.lookup(old, 31).length == 16  # old's deepest blocks went, its first two stayed
    assert index.lookup(new, 31).length == 24
    for block in index.blocks.values():  # no orphans: every parent is held
        assert block.parent == ROOT or block.parent in index.blocks


def test_blocks_move_to_the_host_tier_before_they_are_dropped():
    index = PrefixCache(BLOCK, 2 * 64, 3 * 64, needs_state=False, window=None)
    fill(index, conversation(0, 48))  # 6 blocks: 2 on the device, 3 on the host, 1 dropped
    assert (index.device_bytes, index.host_bytes) == (2 * 64, 3 * 64)
    assert index.stats.demotions == 4 and index.stats.evictions == 1
    assert sum(b.on_host for b in index.blocks.values()) == 3


def test_dropping_a_block_drops_what_hangs_from_it():
    index = PrefixCache(BLOCK, 10**6, 0, needs_state=False, window=None)
    tokens = conversation(0, 32)
    fill(index, tokens)
    index._drop(index.blocks[chain_keys(tokens, BLOCK)[1]])
    assert len(index.blocks) == 1 and index.device_bytes == 64 and index.stats.evictions == 3


# --- the engine ---------------------------------------------------------------------------------------
def engine(target, cache: bool, drafter=None, **overrides) -> Engine:
    cfg = EngineConfig(spec="on", block_size=4, prefill_chunk=CHUNK, prefix_cache=cache, prefix_block=BLOCK,
                       **overrides)
    return Engine(target, TOKENIZER, drafter, cfg)


def drafter_for(target):
    return tiny_drafter(drafter_config(target.cfg, block_size=4))


def agent_turns(engines: list[Engine], seed: int, turns: int, params=SamplingParams(max_new_tokens=12)):
    """An agent loop: each turn's prompt is the whole history plus a new message. Yields each engine's
    result per turn; the history grows with the first engine's reply."""
    history = conversation(seed, 21)
    for turn in range(turns):
        results = [e.complete(history, params) for e in engines]
        yield turn, history, results
        history = history + results[0].token_ids + conversation(seed * 100 + turn, 11)


@pytest.mark.parametrize("target", [LLAMA, HYBRID], ids=["llama", "hybrid"])
def test_greedy_output_is_the_same_with_and_without_the_cache(target):
    drafter = drafter_for(target)
    cached, cold = engine(target, True, drafter), engine(target, False, drafter)
    for turn, history, (hit, ref) in agent_turns([cached, cold], 0, 5):
        assert hit.token_ids == ref.token_ids and hit.spec.histogram == ref.spec.histogram
        if turn:
            previous = len(history) - 11 - 12
            assert hit.cached_tokens == previous - previous % CHUNK, "the previous prompt's whole chunks"
    stats = cached.prefix.index.stats
    assert stats.hit_tokens > stats.miss_tokens


def test_sampled_output_with_the_same_seed_is_the_same_with_the_cache():
    drafter = drafter_for(LLAMA)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7)
    for _, _, (hit, ref) in agent_turns([engine(LLAMA, True, drafter), engine(LLAMA, False, drafter)], 1, 4, params):
        assert hit.token_ids == ref.token_ids


def test_interleaved_conversations_all_hit_in_the_engine():
    drafter = drafter_for(LLAMA)
    cached, cold = engine(LLAMA, True, drafter), engine(LLAMA, False, drafter)
    talks = [agent_turns([cached, cold], seed, 3) for seed in range(3)]
    for _ in range(3):
        for talk in talks:  # one turn of each conversation in turn
            turn, history, (hit, ref) = next(talk)
            assert hit.token_ids == ref.token_ids
            if turn:
                assert hit.cached_tokens >= len(history) - 11 - 12 - (CHUNK - 1)


def test_a_small_budget_evicts_and_outputs_stay_the_same():
    drafter = drafter_for(LLAMA)
    cached = engine(LLAMA, True, drafter, prefix_cache_mb=0.02)  # 20 KiB: a few blocks of 8 tokens
    cold = engine(LLAMA, False, drafter)
    for _, _, (hit, ref) in agent_turns([cached, cold], 2, 5):
        assert hit.token_ids == ref.token_ids
        assert cached.prefix.index.device_bytes <= 0.02 * 2**20
    assert cached.prefix.index.stats.evictions > 0


def test_a_hybrid_hit_inside_a_snapshot_interval_resumes_at_the_snapshot_before_it():
    drafter = drafter_for(HYBRID)
    cached, cold = engine(HYBRID, True, drafter), engine(HYBRID, False, drafter)
    first = conversation(3, 40)  # prefill pieces end at 16, 32 and 40: states at the grid's 16 and 32
    params = SamplingParams(max_new_tokens=6)
    cached.complete(first, params)
    second = first[:37] + conversation(4, 9)  # diverges at 37, inside the interval (32, 48)
    hit, ref = cached.complete(second, params), cold.complete(second, params)
    assert hit.cached_tokens == 32 and hit.token_ids == ref.token_ids


def test_after_a_hit_the_drafter_sees_what_it_sees_without_the_cache(monkeypatch):
    drafter = drafter_for(LLAMA)
    cached, cold = engine(LLAMA, True, drafter), engine(LLAMA, False, drafter)
    first = conversation(5, 37)
    cached.complete(first, SamplingParams(max_new_tokens=8))
    second = first + conversation(6, 14)
    hit = cached.complete(second, SamplingParams(max_new_tokens=1))  # the prefill alone
    cold.complete(second, SamplingParams(max_new_tokens=1))
    assert hit.cached_tokens == 32  # the whole chunks of the first prompt
    mine, theirs, n = cached.steps, cold.steps, len(second)
    assert torch.equal(mine.features.mirror.read(0, n), theirs.features.mirror.read(0, n))
    # the same positions in each layer's context, their K/V computed from the same rows in the same shapes
    for i, (k1, v1), (k2, v2) in zip(range(99), mine.context.kv(), theirs.context.kv()):
        held = theirs.context.tags[i] >= 0
        assert torch.equal(mine.context.tags[i], theirs.context.tags[i])
        assert torch.equal(k1[:, :, held], k2[:, :, held]) and torch.equal(v1[:, :, held], v2[:, :, held])

    drafts = {cached: [], cold: []}
    propose = steps_module.propose
    for e in (cached, cold):  # the first speculative step after the hit drafts what it drafts without it
        monkeypatch.setattr(steps_module, "propose", lambda *a, log=drafts[e], **k: log.append(propose(*a, **k).clone()))
        e.complete(second, SamplingParams(max_new_tokens=5))
    assert drafts[cached] and torch.equal(drafts[cached][0], drafts[cold][0])


def test_a_cancelled_partly_cached_prefill_leaves_the_cache_consistent():
    drafter = drafter_for(LLAMA)
    cached, cold = engine(LLAMA, True, drafter), engine(LLAMA, False, drafter)
    first = conversation(7, 30)
    cached.complete(first, SamplingParams(max_new_tokens=4))
    long = first + conversation(8, 60)  # 16 cached (a whole chunk), 74 to compute in pieces
    asked = []

    def cancel_after_one_piece() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(Cancelled):
        list(cached.generate(long, SamplingParams(max_new_tokens=4), cancel_after_one_piece))
    hit, ref = cached.complete(long, SamplingParams(max_new_tokens=8)), cold.complete(long, SamplingParams(max_new_tokens=8))
    assert hit.token_ids == ref.token_ids and hit.cached_tokens > 30


def test_the_memory_plan_counts_the_prefix_cache():
    drafter = drafter_for(LLAMA)
    off = plan_memory(LLAMA, drafter, 256, EngineConfig())
    on = plan_memory(LLAMA, drafter, 256, EngineConfig(prefix_cache=True))
    taps = len(drafter.cfg.target_layer_ids)
    per_token = LLAMA.kv_bytes_per_token() + LLAMA.feature_bytes_per_token(taps, LLAMA.dtype)
    assert on.parts["prefix cache"] == 256 * per_token and on.total == off.total + 256 * per_token
    sized = plan_memory(LLAMA, drafter, 256, EngineConfig(prefix_cache=True, prefix_cache_mb=3))
    assert sized.parts["prefix cache"] == 3 * 2**20


# --- the server -----------------------------------------------------------------------------------------
def test_the_server_reports_cached_tokens_in_usage_and_metrics():
    import anthropic
    import openai
    from test_server import metric, serving

    drafter = drafter_for(LLAMA)
    with serving(engine(LLAMA, True, drafter)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": " ".join(f"w{i % 80 + 5}" for i in range(40))}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "w7 w8 w9"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # the first prompt's whole chunks (the tiny template's history drops the generation prompt)
        assert cached == (first.usage.prompt_tokens - 1) // CHUNK * CHUNK > 0
        assert metric(url, "deepflash_prefix_cache_hit_tokens_total") == cached
        assert metric(url, "deepflash_prefix_cache_miss_tokens_total") == (
            first.usage.prompt_tokens + second.usage.prompt_tokens - cached)
        assert metric(url, "deepflash_prefix_cache_bytes") > 0

        reply = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=messages)
        assert reply.usage.cache_read_input_tokens > 0
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == second.usage.prompt_tokens


def test_serve_turns_the_prefix_cache_on_unless_asked_not_to():
    from deepflash.cli import build_parser

    args = build_parser().parse_args(["serve", "--prefix-cache-mb", "64"])
    assert not args.no_prefix_cache and args.prefix_cache_mb == 64
    assert build_parser().parse_args(["serve", "--no-prefix-cache"]).no_prefix_cache


# --- on the GPU -----------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and bf16 kernels run on CUDA only")
@pytest.mark.parametrize("kind,dtype", [("llama", torch.bfloat16), ("llama", torch.float32),
                                        ("hybrid", torch.float32)])
def test_on_the_gpu_the_cache_leaves_greedy_output_unchanged(kind, dtype):
    """Graphs captured, kernels on: prefill pieces from a restore point, blocks saved between graph replays,
    host-tier blocks copied back; greedy output with the cache equals output without it."""
    target = (tiny_target(dtype=dtype) if kind == "llama" else hybrid_target("dense", dtype=dtype)).to("cuda")
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4), dtype=dtype).to("cuda")
    cached = engine(target, True, drafter, prefix_cache_mb=0.05, prefix_cache_host_mb=1)  # the host tier serves
    cold = engine(target, False, drafter)
    for seed in range(3):
        for _, _, (hit, ref) in agent_turns([cached, cold], seed, 4):
            assert hit.token_ids == ref.token_ids
    stats = cached.prefix.index.stats
    assert stats.hit_tokens > 0 and stats.demotions > 0  # restores end on the grid: a turn's reply is computed
