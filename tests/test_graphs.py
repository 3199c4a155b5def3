"""CUDA graph capture across engines (GPU only: graphs and cuBLAS workspaces exist on CUDA)."""

import gc

import pytest
import torch

from deepflash.engine import Engine
from deepflash.graphs import StepGraphs
from deepflash.sampling import SamplingParams
from helpers import drafter_config, tiny_drafter, tiny_target_and_tokenizer

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
