"""The Triton projection by GGUF-quantized blocks (kernels/quant_gemv.py) against gguf.quants.dequantize and a
float32 product, for every format it takes: every dequantized weight bit for bit, bf16 and float32 rows, a bias,
3-D rows, a split reduction, the GPU's products, a row's result the same bits whatever the number of rows in the
call, split or not, and a quantized target's greedy contract on the kernel (on the CPU in Triton's interpreter: helpers.triton_device)."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from helpers import triton_device

from deepflash.kernels import quant_gemv

DEVICE = triton_device()
T = gguf.GGMLQuantizationType
FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
# byte offsets of each block's float16 fields (d, and m / dmin where there is one)
HALVES = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q2_K: (80, 82),
          T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype, n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row bytes]: random bytes with each block's float16 fields set to modest finite values
    (weights of about 0.01-1)."""
    qk, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, cols // qk, nbytes), dtype=torch.uint8, generator=gen)
    scale = 0.05 if qk == 32 else 0.005  # k-quants multiply d by a sub-block scale of up to 63
    for off in HALVES[qtype]:
        half = ((torch.rand(n, cols // qk, generator=gen) * 2 - 1) * scale).to(torch.float16)
        data[:, :, off:off + 2] = half.view(torch.uint8).reshape(n, cols // qk, 2)
    return data.reshape(n, -1)


def reference_weight(blocks: torch.Tensor, qtype) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), qtype).astype(np.float32))


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_rows' quantization in torch: x [rows, cols] as int8 q and float32 scales d per 256 columns (q = x / d
    rounded half away from zero, d = max |x| / 127), [rows, cols] each (d repeated over its chunk)."""
    chunks = x.float().reshape(x.shape[0], -1, 256)
    peak = chunks.abs().amax(-1, keepdim=True)
    scaled = chunks * torch.where(peak > 0, 127.0 / torch.where(peak > 0, peak, 1.0), 0.0)
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return q.reshape(x.shape), (peak / 127.0).expand_as(chunks).reshape(x.shape)


def integer_product(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of x's int8 form with the float32 weights (float64 sums), and the bound of its distance from
    x's: d / 2 * |w| summed (each quantized element is within half a step of x's)."""
    q, d = quantized_rows(x)
    return (q * d).double() @ weight.double().T, (d / 2).double() @ weight.abs().double().T


def rows(count: int, cols: int, dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, cols, generator=gen).to(dtype)


def run(x, blocks, qtype, cols, bias=None, slices=None, tile=None, upcast=None):
    """The kernel's product on DEVICE: linear's tiling unless `tile`, its split unless `slices` (forced)."""
    tile = tile or quant_gemv.tiling(int(qtype), x.dtype)
    upcast = quant_gemv.INTERPRETED if upcast is None else upcast
    return quant_gemv._launch(x.to(DEVICE), blocks.to(DEVICE), int(qtype), cols, None if bias is None else bias.to(DEVICE),
                        tile, upcast, slices).cpu()


def columns(qtype) -> int:
    """Columns of the small weights: 2 steps (the 32-column formats: 11 blocks, the second step of 8 partial)."""
    return 512 if qtype in K_QUANTS else 352


def test_api():
    assert sorted(quant_gemv.SUPPORTED) == sorted(int(t) for t in FORMATS)
    for t in FORMATS:
        assert quant_gemv.BLOCKS[int(t)] == gguf.GGML_QUANT_SIZES[t], t.name
    assert quant_gemv.fits(torch.zeros(1, 64, dtype=torch.bfloat16))
    assert quant_gemv.fits(torch.zeros(16, 64, dtype=torch.bfloat16))
    assert quant_gemv.fits(torch.zeros(2, 8, 64, dtype=torch.float32))
    assert not quant_gemv.fits(torch.zeros(17, 64, dtype=torch.bfloat16))
    assert not quant_gemv.fits(torch.zeros(1, 64, dtype=torch.float16))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_every_weight_dequantizes_as_gguf_does(qtype):
    """One-hot float32 rows pick every column of a weight out exactly (16 a call, every other call with the
    reduction split in 2): equal to gguf's dequantization bit for bit. 40 rows: a partial tile. bf16 rows
    get the weights rounded to bf16 to nearest (the interpreter's conversion truncates)."""
    n, cols = 40, columns(qtype)
    blocks = random_blocks(qtype, n, cols, seed=int(qtype))
    weight = reference_weight(blocks, qtype)
    eye = torch.eye(cols)
    for i, c0 in enumerate(range(0, cols, 16)):
        got = run(eye[c0:c0 + 16], blocks, qtype, cols, slices=2 if i % 2 else None)
        assert torch.equal(got.T, weight[:, c0:c0 + 16]), c0
    picked = torch.arange(16) * (cols // 16) + (torch.arange(16) * 11) % (cols // 16)
    got = run(eye[picked].to(torch.bfloat16), blocks, qtype, cols)
    assert torch.equal(got.T, weight[:, picked].to(torch.bfloat16))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_kernel_matches_dequantize_then_product(qtype, dtype):
    """5 rows (3-D for half the formats), a bias for some: the float32 product of the weights rounded to the
    rows' dtype."""
    n, cols = 40, columns(qtype)
    blocks = random_blocks(qtype, n, cols, seed=int(qtype))
    weight = reference_weight(blocks, qtype)
    x = rows(5, cols, dtype)
    bias = torch.randn(n).to(dtype) if qtype in (T.Q4_K, T.Q5_0, T.Q6_K) else None
    shape = (5, n) if FORMATS.index(qtype) % 2 else (1, 5, n)
    got = quant_gemv.linear(x.reshape(*shape[:-1], cols).to(DEVICE), blocks.to(DEVICE), int(qtype), cols,
                      None if bias is None else bias.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == shape
    got = got.reshape(5, n)
    plus = 0 if bias is None else bias.float()
    exact = x.float() @ weight.T + plus  # the float32 weights
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
    elif quant_gemv.integer(int(qtype), dtype):  # the rows quantized to int8 (int8_rows.py), the sums exact
        product, bound = integer_product(x, weight)
        torch.testing.assert_close(got.float(), (product + plus).to(dtype).float(), rtol=8e-3, atol=1e-2)
        assert ((got.double() - exact.double()).abs() <= bound + 4e-3 * exact.abs() + 1e-2).all()
    else:  # the weights rounded to bf16, as a dequantize-to-bf16-then-GEMM would round them
        rounded = x.float() @ weight.to(dtype).float().T + plus
        torch.testing.assert_close(got.float(), rounded.to(dtype).float(), rtol=8e-3, atol=1e-2)
        # against the float32 weights: the bf16 weights' error, under 2^-9 of each product
        assert (got.float() - exact).abs().max() <= 2e-3 * (x.float().abs() @ weight.abs().T).max()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q3_K, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
def test_a_split_reduction_adds_its_slices_in_order(qtype):
    """A reduction split in 2, 3 and 4 slices (whole steps, none empty; 4 steps under the interpreter's tiling):
    the float32 product within rounding of the whole reduction, the bias added once, and the arrival counters
    back at zero for the next call."""
    n, cols = 40, 1024 if qtype in K_QUANTS else 1024 - 32  # 31 blocks of 32: a partial last step
    blocks = random_blocks(qtype, n, cols, seed=5)
    weight = reference_weight(blocks, qtype)
    x = rows(3, cols, torch.float32, seed=2)
    bias = torch.randn(n)
    want = x @ weight.T + bias
    whole = run(x, blocks, qtype, cols, bias, slices=1)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-4)
    tile = quant_gemv.exact_tiling(int(qtype), torch.float32)
    for slices in (2, 3, 4):
        _, steps, count, per = quant_gemv.plan(int(qtype), n, cols, tile, 1, slices)
        assert 2 <= count <= slices and (count - 1) * per < steps <= count * per  # whole slices, none empty
        got = run(x, blocks, qtype, cols, bias, slices=slices)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-4)  # the slices sum in another association
        assert not quant_gemv.arrival_counters("quant_gemv", quant_gemv.MAX_BLOCKS, torch.device(DEVICE)).any()


CASES = [(T.Q4_K, torch.bfloat16, None), (T.Q4_K, torch.bfloat16, 4), (T.Q6_K, torch.bfloat16, 3),
         (T.Q8_0, torch.float32, None), (T.Q8_0, torch.float32, 4), (T.Q6_K, torch.float32, None)]


@pytest.mark.parametrize("qtype, dtype, slices", CASES, ids=lambda c: getattr(c, "name", str(c)).replace("torch.", ""))
def test_a_verified_row_is_computed_exactly_as_a_decoded_one(qtype, dtype, slices):
    """A 16-row call (a verify step) gives each row the bits a 1-row call (a decode step) gives it, and a
    3-row call the same again, with the reduction whole or split (4 steps)."""
    n, cols = 32, 1024
    blocks = random_blocks(qtype, n, cols)
    bias = torch.randn(n).to(dtype)
    x = rows(16, cols, dtype)
    verify = run(x, blocks, qtype, cols, bias, slices)
    for i in range(16):
        assert torch.equal(run(x[i:i + 1], blocks, qtype, cols, bias, slices), verify[i:i + 1]), i
    assert torch.equal(run(x[4:7], blocks, qtype, cols, bias, slices), verify[4:7])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q2_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_gpu_products(qtype):
    """The GPU's tilings in the interpreter: tl.dot with the weights second and first (GPU_TILINGS' 32
    rows a program, 8 blocks a step) and in "ieee" precision (FLOAT32_TILING), here with float32 rows (the
    interpreter's bf16 tl.dot returns garbage; the GPU runs it with bf16), split in 2. 40 outputs end
    inside a tile of 32; 11 blocks of 32 inside a step of 8."""
    n, cols = 40, columns(qtype)
    blocks = random_blocks(qtype, n, cols, seed=11)
    weight = reference_weight(blocks, qtype)
    bias = torch.randn(n)
    x = rows(3, cols, torch.float32).reshape(1, 3, cols)
    want = x @ weight.T + bias
    gpu = quant_gemv.GPU_TILINGS[int(qtype)]
    for tile in (gpu, quant_gemv.Tiling(gpu.block_n, gpu.blocks, gpu.warps, gpu.stages, gpu.waves, not gpu.weight_first),
                 quant_gemv.FLOAT32_TILING):
        got = run(x, blocks, qtype, cols, bias, slices=2, tile=tile, upcast=False)
        assert got.shape == (1, 3, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_rows_quantize_as_the_reference_does():
    """int8_rows.quantized_rows: q, d and the sums of q per 16 columns as the torch reference computes them, bit
    for bit (a zero chunk: q and d zeros), in a tile of 16 rows."""
    from deepflash.kernels import int8_rows

    x = rows(3, 768, torch.bfloat16) * 4
    x[1, 256:512] = 0
    q, scales, sums = (t.cpu() for t in int8_rows.quantized_rows(x.to(DEVICE)))
    want_q, want_d = quantized_rows(x)
    assert q.shape == (16, 768) and scales.shape == (16, 3) and sums.shape == (16, 48)
    assert torch.equal(q[:3].float(), want_q) and torch.equal(scales[:3], want_d[:, ::256])
    assert torch.equal(sums[:3], want_q.reshape(3, 48, 16).sum(-1).int())


@pytest.mark.parametrize("offset", [False, True])
def test_the_norm_and_silu_kernels_quantize_rows_as_quantized_rows_does(offset):
    """layer_ops.add_rms_norm and silu_mul with rows8 write the int8 form of the rows they make, bit for bit what
    int8_rows.quantized_rows gives on those rows (a launch saved before each integer-path projection); widths
    that end inside silu_mul's 1024-column programs and in a norm row's padding."""
    from deepflash.kernels import int8_rows, layer_ops

    for width in (512, 1280):
        x, y = (rows(3, width, torch.bfloat16, seed).to(DEVICE) for seed in (2, 3))
        gain = (0.1 * rows(1, width, torch.bfloat16, 4)[0]).to(DEVICE)
        made = [int8_rows.row_buffers(width, DEVICE) for _ in range(2)]
        _, normed = layer_ops.add_rms_norm(x, y, gain, 1e-6, offset=offset, rows8=made[0])
        product = layer_ops.silu_mul(torch.cat([x, y], dim=-1), rows8=made[1])
        for out, rows8 in zip((normed, product), made):
            want = int8_rows.quantized_rows(out)
            for got, expected in zip(rows8, want):
                assert torch.equal(got[:3], expected[:3]), width


def test_a_projection_of_several_formats_writes_each_parts_columns():
    """QuantizedWeight.project on the kernel: a fused weight of Q4_K and Q6_K parts (as a Q4_K_M file's q/k and v)
    quantizes the rows once and writes each part's columns of one output, bit for bit each part's own product,
    and the same with the rows' int8 form handed in (int8_buffers)."""
    from deepflash.kernels import int8_rows
    from deepflash.quant.gguf_blocks import block_format
    from deepflash.quant.weight import QuantizedWeight

    parts = [(block_format(T.Q4_K), random_blocks(T.Q4_K, 48, 512, 5)),
             (block_format(T.Q6_K), random_blocks(T.Q6_K, 32, 512, 6))]
    weight = QuantizedWeight([(fmt, blocks.to(DEVICE)) for fmt, blocks in parts], 512, torch.bfloat16)
    x = rows(3, 512, torch.bfloat16).to(DEVICE)
    got = weight.project(x, None, kernels=True)
    want = torch.cat([quant_gemv.linear(x, blocks.to(DEVICE), int(fmt.ggml_type), 512) for fmt, blocks in parts], -1)
    assert torch.equal(got, want)
    handed = weight.int8_buffers(x)
    assert handed is not None and weight.int8_buffers(x.float()) is None  # float32 rows stay exact
    for buffer, made in zip(handed, int8_rows.quantized_rows(x)):
        buffer.copy_(made)
    assert torch.equal(weight.project(x, None, kernels=True, rows8=handed), got)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_integer_products_on_the_gpu_tiling(qtype):
    """The integer path's GPU tiling (64 weight rows a program) in the interpreter, whole and split in 2: 200
    outputs end inside a program's rows (the rows past the weight read its last row and are not stored)."""
    n, cols = 200, 512
    blocks = random_blocks(qtype, n, cols, seed=3)
    x = rows(4, cols, torch.float32).to(torch.bfloat16)
    product, _ = integer_product(x.float(), reference_weight(blocks, qtype))
    for slices in (1, 2):
        got = run(x, blocks, qtype, cols, slices=slices, tile=quant_gemv.INTEGER_TILING, upcast=False)
        torch.testing.assert_close(got.float(), product.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-2)


def test_the_split_comes_from_the_shape():
    """Qwen3-8B's Q4_K_M decode weights on an H100's 132 SMs: weights of few row blocks split until there are
    about `waves` (3) programs an SM (1.5-6: slices are whole steps), those with enough row blocks stay whole;
    nothing depends on the number of rows (plan has no such argument)."""
    sms = 132
    for n, cols, fmt in ((4096, 4096, quant_gemv.Q4_K), (6144, 4096, quant_gemv.Q4_K), (4096, 12288, quant_gemv.Q6_K),
                         (12288, 4096, quant_gemv.Q4_K), (24576, 4096, quant_gemv.Q4_K), (151936, 4096, quant_gemv.Q6_K),
                         (1024, 4096, quant_gemv.Q4_K), (1024, 4096, quant_gemv.Q8_0)):
        tile = quant_gemv.GPU_TILINGS[fmt]
        _, steps, slices, per = quant_gemv.plan(fmt, n, cols, tile, sms)
        row_blocks = -(-n // tile.block_n)
        assert (slices - 1) * per < steps <= slices * per, (n, cols)  # whole, non-empty slices
        programs = row_blocks * slices
        if row_blocks >= tile.waves * sms:
            assert slices == 1, (n, cols)
        else:
            assert 1.5 * sms <= programs <= 6 * sms, (n, cols, slices, programs)
    assert quant_gemv.plan(quant_gemv.Q4_K, 4096, 4096, quant_gemv.GPU_TILINGS[quant_gemv.Q4_K], 1)[2] == 1  # the CPU: one slice


def test_empty_and_bounds():
    blocks = random_blocks(T.Q4_K, 8, 256)
    assert run(torch.zeros(0, 256), blocks, T.Q4_K, 256).shape == (0, 8)
    with pytest.raises(AssertionError):
        quant_gemv.linear(torch.zeros(17, 256), blocks, int(T.Q4_K), 256)


@pytest.mark.parametrize("block", [1, 4])
def test_quantized_target_on_the_kernels_keeps_the_greedy_contract(block):
    """A tiny target kept in Q4_0 / Q5_1 blocks on the target kernels: its projections of a step's rows
    through this kernel, speculative output equals plain output."""
    from gguf import GGMLQuantizationType as T
    from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

    from deepflash.engine.config import EngineConfig
    from deepflash.engine.engine import Engine
    from deepflash.engine.sampling import SamplingParams
    from deepflash.quant.gguf_blocks import block_format
    from deepflash.quant.random_weights import quantize_random_

    fmt_of = lambda name: block_format(T.Q5_1 if "v_proj" in name else T.Q4_0)  # noqa: E731
    target = quantize_random_(tiny_target(dtype=torch.float32), fmt_of, scale=8.0).to(DEVICE)
    drafter = tiny_drafter(drafter_config(target.cfg), dtype=torch.float32).to(DEVICE)
    kernels = EngineConfig(target_kernels="triton")
    params = SamplingParams(max_new_tokens=12)
    plain = Engine(target, tiny_tokenizer(), config=kernels).complete([5, 6, 7], params)
    spec = Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(spec="on", target_kernels="triton",
                                                                          block_size=block)).complete([5, 6, 7], params)
    assert spec.token_ids == plain.token_ids
