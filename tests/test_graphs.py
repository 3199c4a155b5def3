"""CUDA graph capture across engines (GPU only: graphs and cuBLAS workspaces exist on CUDA)."""

import gc

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target_and_tokenizer

from deepflash.engine.engine import Engine
from deepflash.engine.graphs import StepGraphs
from deepflash.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs and cuBLAS's per-stream workspaces exist on CUDA only")


def test_engines_capture_on_the_same_streams():
    first = StepGraphs([], torch.device("cuda"))
    second = StepGraphs([], torch.device("cuda", torch.cuda.current_device()))
    assert all(a is b for a, b in zip(first.streams, second.streams))


def test_an_engine_leaves_no_memory_behind():
    """The second engine of a process must leave allocated memory where the first left it: streams made
    per engine kept a cuBLAS workspace each (32 MiB on Hopper) for the rest of the process."""
    target, tokenizer = tiny_target_and_tokenizer(torch.device("cuda"))
    drafter = tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).cuda()

    def run_engine():
        engine = Engine(target, tokenizer, drafter, spec="on", max_ctx=128)
        engine.complete(list(range(5, 40)), SamplingParams(max_new_tokens=20))

    run_engine()
    gc.collect()
    after_first = torch.cuda.memory_allocated()
    run_engine()
    gc.collect()
    assert torch.cuda.memory_allocated() == after_first


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_feature_commit_beside_the_target_changes_nothing(cuda_graphs, monkeypatch):
    """spec.OVERLAP_CONTEXT puts a verify step's feature commit on a stream of its own (spec.Steps.aside):
    the output, the feature ring and the drafter's context K/V after a request equal, bit for bit, those
    of the commit on the step's own stream, with and without CUDA graphs."""
    from deepflash.engine import steps as spec

    target, tokenizer = tiny_target_and_tokenizer(torch.device("cuda"))
    drafter = tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).cuda()
    runs = []
    for beside in (True, False):
        monkeypatch.setattr(spec, "OVERLAP_CONTEXT", beside)
        engine = Engine(target, tokenizer, drafter, spec="on", max_ctx=128, cuda_graphs=cuda_graphs)
        assert (engine.steps.aside is not None) == beside
        result = engine.complete(list(range(5, 40)), SamplingParams(max_new_tokens=40))
        runs.append((result.token_ids, engine.steps.features.ring.data.clone(),
                     [k.clone() for k in engine.steps.context.k]))
    (out, ring, keys), (out_after, ring_after, keys_after) = runs
    assert out == out_after and torch.equal(ring, ring_after)
    assert all(torch.equal(a, b) for a, b in zip(keys, keys_after))
