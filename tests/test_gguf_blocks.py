"""deepflash.quant.gguf_blocks against the gguf package's numpy dequantization, bit for bit."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from deepflash.quant.gguf_blocks import FORMATS, block_format, dequantize, random_blocks, row_bytes

LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # the types gguf's Python package can quantize
ALL = LEGACY + [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def _gguf(blocks: torch.Tensor, qtype: T) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype))


def _assert_bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # Every format computes in gguf's operation order, so float32 results match exactly, signs of zero included.
    assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def test_formats_are_exactly_the_supported_types():
    assert sorted(FORMATS) == sorted(int(t) for t in ALL)
    for t in ALL:
        fmt = block_format(t)
        assert fmt.name == t.name and fmt.ggml_type == t
        assert (fmt.block, fmt.nbytes) == gguf.GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype):
    fmt = block_format(qtype)
    blocks = random_blocks(6, 512, fmt, torch.Generator().manual_seed(int(qtype)))
    assert blocks.dtype == torch.uint8 and blocks.shape == (6, row_bytes(fmt, 512))
    _assert_bits_equal(dequantize(blocks, fmt), _gguf(blocks, qtype))


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_quantized_blocks_match_gguf(qtype):
    data = np.random.default_rng(int(qtype)).standard_normal((5, 256), dtype=np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(data, qtype))
    ours = dequantize(blocks, block_format(qtype))
    _assert_bits_equal(ours, _gguf(blocks, qtype))
    assert (ours - torch.from_numpy(data)).abs().max() < 0.5  # sanity: the quantization round-trips


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_leading_dims_and_bf16(qtype):
    fmt = block_format(qtype)
    experts = random_blocks(3 * 4, 512, fmt, torch.Generator().manual_seed(1)).view(3, 4, -1)  # [E, N, bytes]
    flat = dequantize(experts.view(12, -1), fmt)
    assert torch.equal(dequantize(experts, fmt), flat.view(3, 4, 512))
    # a strided view (every other expert) is read as well as a contiguous one
    assert torch.equal(dequantize(experts[::2], fmt), flat.view(3, 4, 512)[::2])
    assert torch.equal(dequantize(experts, fmt, torch.bfloat16), flat.view(3, 4, 512).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_blocks_have_sane_magnitude(qtype):
    cols = 4096
    w = dequantize(random_blocks(16, cols, block_format(qtype), torch.Generator().manual_seed(2)), block_format(qtype))
    assert torch.isfinite(w).all()
    scaled = w * cols**0.5  # weights are sized about 1 / sqrt(cols)
    assert 0.1 < scaled.std() < 1 and scaled.abs().max() < 2


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.IQ4_XS, T.IQ2_XXS, T.TQ1_0, T.MXFP4, 9999])
def test_unsupported_types_have_no_format(qtype):
    assert block_format(qtype) is None


def test_rows_must_be_whole_blocks():
    q4k = block_format(T.Q4_K)
    assert row_bytes(q4k, 512) == 2 * 144
    with pytest.raises(ValueError, match=r"256.*4000|4000.*256"):
        row_bytes(q4k, 4000)
    with pytest.raises(ValueError):
        dequantize(torch.zeros(2, 145, dtype=torch.uint8), q4k)
