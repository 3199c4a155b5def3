"""CUDA graphs of the decode steps: keys that do not grow with sampling values, a bounded cache (on the
CPU, with a stand-in capture that counts), and capture across engines (GPU only)."""

import gc
from types import SimpleNamespace

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_target_and_tokenizer, tiny_tokenizer

from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.graphs import StepGraphs
from deepflash.engine.sampling import SamplingParams

gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="CUDA graphs and cuBLAS's per-stream workspaces exist on CUDA only")


class CountingGraphs(StepGraphs):
    """StepGraphs on the CPU with a stand-in capture: a 'graph' replays the function it was captured from,
    closures and all, as a CUDA graph replays the kernels (and the device buffers) its capture recorded.
    So a step that read a request's sampling values from its host-side params, not the device buffers,
    would replay the first request's values here as on the GPU."""

    def __init__(self, engine: Engine, max_graphs: int = 256):
        super().__init__(engine.state.buffers(), engine.device, cache=engine.cache, max_graphs=max_graphs)
        self.enabled = True

    def _capture(self, fn):
        return SimpleNamespace(replay=fn)


TARGET = tiny_target()
DRAFTER = tiny_drafter(drafter_config(TARGET.cfg))


def counted_engine(target=TARGET, drafter=DRAFTER) -> Engine:
    engine = Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(spec="on"))
    engine.graphs = CountingGraphs(engine)
    return engine


def test_a_thousand_sampling_values_capture_a_handful_of_graphs():
    """Temperature, top-k and top-p are device buffers: graphs are keyed on the sampling mode alone, so a
    server that sees 1,000 distinct values captures a few graphs, not 1,000."""
    small = tiny_target(dtype=torch.float32, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    engine = counted_engine(small, drafter=None)
    for i in range(1000):
        params = SamplingParams(temperature=0.3 + i / 1000, top_p=1.0 if i % 2 else 0.5 + i / 4000,
                                top_k=0 if i % 3 else 1 + i % 40, max_new_tokens=2, seed=i)
        engine.complete([5, 6, 7, 8], params)
    assert engine.graphs.captures == 4  # the prefill and the plain step, in the "sample" and "filtered" modes


@pytest.mark.parametrize("values", [dict(temperature=1.3), dict(temperature=0.6, top_k=7),
                                    dict(temperature=0.9, top_p=0.6), dict(temperature=0.5, top_k=30, top_p=0.8)])
def test_a_replayed_graph_samples_with_the_current_request_values(values):
    """A graph captured for one request's values, replayed for another's, samples what an engine that
    never saw the first request samples (the values come from the device buffers, not the capture)."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    first = dict(temperature=0.7, top_k=3 if "top_k" in values else 0, top_p=0.9 if "top_p" in values else 1.0)
    engine = counted_engine()
    engine.complete(prompt, SamplingParams(max_new_tokens=12, seed=1, **first))
    captured = engine.graphs.captures
    got = engine.complete(prompt, SamplingParams(max_new_tokens=12, seed=2, **values))
    assert engine.graphs.captures == captured  # every step replayed a graph of the first request
    fresh = counted_engine().complete(prompt, SamplingParams(max_new_tokens=12, seed=2, **values))
    assert got.token_ids == fresh.token_ids


def test_the_graph_cache_is_bounded_and_drops_the_least_recently_used():
    engine = counted_engine()
    graphs = CountingGraphs(engine, max_graphs=2)
    runs = []
    for key in ["a", "b", "a", "c", "b"]:
        graphs.run(key, lambda key=key: runs.append(key))
    assert runs == ["a", "b", "a", "c", "b"]  # every run ran its step
    assert list(graphs.graphs) == ["c", "b"] and graphs.captures == 4  # "b" was dropped for "c", then taken again


@gpu
def test_engines_capture_on_the_same_streams():
    first = StepGraphs([], torch.device("cuda"))
    second = StepGraphs([], torch.device("cuda", torch.cuda.current_device()))
    assert all(a is b for a, b in zip(first.streams, second.streams))


@gpu
def test_an_engine_leaves_no_memory_behind():
    """The second engine of a process must leave allocated memory where the first left it: streams made
    per engine kept a cuBLAS workspace each (32 MiB on Hopper) for the rest of the process."""
    target, tokenizer = tiny_target_and_tokenizer(torch.device("cuda"))
    drafter = tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).cuda()

    def run_engine():
        engine = Engine(target, tokenizer, drafter, config=EngineConfig(spec="on", max_ctx=128))
        engine.complete(list(range(5, 40)), SamplingParams(max_new_tokens=20))

    run_engine()
    gc.collect()
    after_first = torch.cuda.memory_allocated()
    run_engine()
    gc.collect()
    assert torch.cuda.memory_allocated() == after_first


@gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_feature_commit_beside_the_target_keeps_the_context_exact(cuda_graphs):
    """A verify step commits its block's features on a stream of its own (steps.Steps.aside), beside the
    target's last layers: after a request, the drafter's context K/V of every committed position equal those
    rebuilt on the step's own stream from the mirror (to rounding: the rebuild projects all rows in one GEMM,
    the steps a block at a time), and the output is plain decoding's."""
    target, tokenizer = tiny_target_and_tokenizer(torch.device("cuda"))
    drafter = tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).cuda()
    prompt, params = list(range(5, 40)), SamplingParams(max_new_tokens=40)
    engine = Engine(target, tokenizer, drafter, config=EngineConfig(spec="on", max_ctx=128, cuda_graphs=cuda_graphs))
    assert engine.steps.aside is not None
    result = engine.complete(prompt, params)
    engine.wait_idle()
    context = engine.steps.context
    committed = int(engine.state.start)
    keys = [k.clone() for k in context.k]
    tags = [t.clone() for t in context.tags]
    context.rebuild(*engine.steps.features.context(committed))
    for before, after, tag in zip(keys, context.k, tags):
        held = (tag >= 0) & (tag < committed)
        assert held.sum() > len(prompt)
        torch.testing.assert_close(before[:, :, held], after[:, :, held], rtol=1e-4, atol=1e-4)
    plain = Engine(target, tokenizer, config=EngineConfig(max_ctx=128, cuda_graphs=cuda_graphs)).complete(prompt, params)
    assert result.token_ids == plain.token_ids


def test_the_drafter_window_ends_a_kv_bucket():
    """Steps below the drafter's window get a span within it (its ring has not wrapped: the draft runs on the
    decode kernel); past it, powers of two again; never beyond the cache."""
    from deepflash.engine.graphs import kv_bucket

    assert kv_bucket(32784, 131200) == 65536
    assert kv_bucket(32784, 131200, window=40960) == 40960
    assert kv_bucket(40960, 131200, window=40960) == 40960
    assert kv_bucket(40961, 131200, window=40960) == 65536
    assert kv_bucket(300, 131200, window=40960) == 512
    assert kv_bucket(32784, 36000, window=40960) == 36000
