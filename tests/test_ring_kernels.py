"""The Triton ring kernels (kernels/rings.py) store and decode the same bytes as kernels/row_formats.py's torch forms
(on the CPU in Triton's interpreter: helpers.triton_device)."""

import pytest
import torch
from helpers import triton_device

from deepflash.drafter.features import FeatureRing, FeatureStore
from deepflash.engine.config import EngineConfig
from deepflash.kernels.row_formats import FORMATS

DEVICE = triton_device()
CUDA = DEVICE == "cuda"


def awkward_rows(n: int, width: int) -> torch.Tensor:
    """Random rows with an all-zero block, one of zeros of both signs, a negative peak, a positive peak tie
    with its opposite after it, opposite peaks with -m first and large values."""
    rows = torch.randn(n, width, generator=torch.Generator().manual_seed(width)) * 7
    rows[0, :32] = 0
    rows[0, 32:64] = 0
    rows[0, 40] = -0.0  # after a +0.0: q4_0's peak is +0.0, so its scale is -0.0
    if n > 2:
        rows[1, 5] = -rows[1, :32].abs().max() - 1
        rows[2, 3] = rows[2, 9] = rows[2, :32].abs().max() + 2
        rows[2, 20] = -rows[2, 3]  # +m first
        rows[2, 40 % width] = 3e4
        rows[1, 35], rows[1, 50] = -60.0, 60.0  # -m first
    return rows.to(DEVICE)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("width", [2880, 96])
@pytest.mark.parametrize("scaled", [False, True])
def test_triton_rings_hold_the_same_bytes_as_the_torch_ones(fmt, width, scaled):
    if fmt == "bf16" and not CUDA:
        pytest.skip("Triton's interpreter rounds float32 -> bfloat16 by truncation; the GPU rounds to nearest even")
    # per-channel powers of two from 2^-3 to 2^3 (features.storage_scale)
    scale = torch.exp2(torch.arange(width) % 7 - 3.0).to(DEVICE) if scaled else None
    torch_ring, triton_ring = (FeatureRing(6, width, FORMATS[fmt], DEVICE, slack=4, kernels=k, channel_scale=scale)
                               for k in ("torch", "triton"))
    end = 0
    for n in [7, 1, 10, 3]:  # runs that wrap and one that overflows the ring (capacity 10)
        rows = awkward_rows(n, width)
        for ring in (torch_ring, triton_ring):
            ring.write(torch.arange(end, end + n, device=DEVICE), rows)
        end += n
        assert torch.equal(torch_ring.tags, triton_ring.tags)
        assert torch.equal(torch_ring.data, triton_ring.data)
        assert torch.equal(torch_ring.read(end - 6, 6), triton_ring.read(end - 6, 6))


def test_store_commit_returns_what_the_mirror_holds():
    store = FeatureStore(8, 64, "q4_0", torch.float32, DEVICE, DEVICE, slack=2, kernels="triton")
    rows = awkward_rows(5, 64)
    kept, decoded = store.commit(torch.arange(5, device=DEVICE), rows)
    assert torch.equal(kept.cpu(), torch.arange(5))
    assert torch.equal(decoded, FORMATS["q4_0"].decode(FORMATS["q4_0"].encode(rows)))


@pytest.mark.parametrize("feature_dtype", ["f32", "q4_0"])
def test_engine_with_triton_rings_keeps_the_greedy_contract(feature_dtype):
    """The engine on Triton rings (the default on CUDA, where this also runs them under CUDA graphs):
    greedy speculative output == greedy plain output, with a window shorter than the prompt."""
    from helpers import drafter_config, llama_config, tiny_drafter, tiny_tokenizer

    from deepflash.engine.engine import Engine
    from deepflash.engine.sampling import SamplingParams
    from deepflash.models import materialize, random_model

    # built on the device: the fused projections are not parameters, so .to() would leave them behind
    target = random_model(llama_config(), DEVICE, torch.float32, std=0.2)
    drafter = materialize(tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).to(DEVICE), DEVICE)
    tokenizer = tiny_tokenizer()
    ids = torch.randint(5, 90, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=24)
    spec = Engine(target, tokenizer, drafter, config=EngineConfig(spec="on", feature_dtype=feature_dtype, feat_ring_cap=16, ring_kernels="triton")).complete(ids, params)
    assert spec.token_ids == Engine(target, tokenizer).complete(ids, params).token_ids


@pytest.mark.parametrize("shape", [(8, 1), (64, 8), (16, 1, 4, 3), (32, 2, 5, 2)])
@pytest.mark.parametrize("scaled", [False, True])
def test_every_program_shape_stores_the_same_bytes(shape, scaled):
    """bench rings --triton-shapes times other shapes: they must store the same bytes, also where the
    last program's rows run past the rows written (3 rows: a program takes 1, 4 or 5), with the scale
    loaded once per program for all its rows."""
    from deepflash.kernels.config import Shape

    scale = torch.exp2(torch.arange(2880) % 7 - 3.0).to(DEVICE) if scaled else None
    for fmt in ("f16", "q8_0", "q4_0"):
        rows = awkward_rows(3, 2880)
        torch_ring, triton_ring = (FeatureRing(4, 2880, FORMATS[fmt], DEVICE, kernels=k, channel_scale=scale,
                                               shape=Shape(*shape) if k == "triton" else None)
                                   for k in ("torch", "triton"))
        torch_ring.write(torch.arange(3, device=DEVICE), rows)
        triton_ring.write(torch.arange(3, device=DEVICE), rows)
        assert torch.equal(torch_ring.tags, triton_ring.tags)
        assert torch.equal(torch_ring.data, triton_ring.data)
        assert torch.equal(torch_ring.read(0, 3), triton_ring.read(0, 3))
