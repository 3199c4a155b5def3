"""Two small Triton kernels of a decoder layer: a residual add fused with the RMSNorm after it (both of
a layer's adds: llama.DecoderLayer.fused_forward), and SwiGLU's silu(gate) * up. Each use replaces two
kernels of a decode step, whose launches and round trips through memory cost more than their
arithmetic (profile_step.py: the adds and the silu / multiply took ~160 of the SmolLM2-135M-shaped
step's 1412 us). Chosen with the target's other Triton kernels (TargetModel.use_kernels);
`TRITON_INTERPRET=1` runs them on the CPU for the tests. Decode and verify steps fold both into the
projection after them (kernels/gemv.py); these serve longer inputs (prefill), MoE layers and the final
norm. row_norm normalises each row in one program for Qwen3.5's norms (models/qwen3_5.py,
models/gated_deltanet.py), so that a verify step's rows get decode steps' bits.
"""

from __future__ import annotations

import torch

from . import pdl
from .triton_support import tl, triton

SILU_BLOCK = 1024  # values of a row per silu_mul program
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # row_norm's inputs; float64 keeps torch's forms
OFFSET_RMS, GATED_RMS = 0, 2  # row_norm's modes


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 total: torch.Tensor | None = None, offset: bool = False,
                 rows8: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y) * weight) over the last dim; the sum is rounded to the input dtype before
    it is normalised, as the torch form does, and written to `total` when given (a feature tap's:
    layers.tap). y None: (x, rms_norm(x) * weight) by the same kernel (the first layer's input, the
    embeddings). offset: scale by (1 + weight) instead (Qwen3.5's norms, whose weights are offsets).
    rows8: int8_rows.row_buffers to write the normed rows' int8 form to, as int8_rows.quantized_rows would."""
    width = x.shape[-1]
    x = x.contiguous()
    normed = torch.empty_like(x)
    total = x if y is None else torch.empty_like(x) if total is None else total
    block = triton.next_power_of_2(width)
    q, scales, sums = rows8 or (x, x, x)
    # one program holds a whole row (the norm's reduction); wide rows get more warps, as in Triton's
    # layer-norm tutorial: 4 up to 1024 values (SmolLM2's 576), 8 from 2048 (Qwen3-8B's 4096)
    _add_rms_norm[(x.numel() // width,)](x, x if y is None else y.contiguous(), weight, total, normed, q, scales,
                                         sums, width, eps, BLOCK=block, ADD=y is not None, OFFSET=offset,
                                         QUANTIZE=rows8 is not None, COLS=width if rows8 is not None else 0,
                                         num_warps=min(max(block // 256, 4), 8))
    return total, normed


def row_norm(x: torch.Tensor, mode: int, eps: float, weight: torch.Tensor,
             gate: torch.Tensor | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """A norm over the last dim, each row in one program that reduces its whole row in one block: a row's
    result is the same bit for bit whatever the number of rows, where torch's reductions pick another
    strategy for 1 and 16 rows on CUDA (a verify step must normalise each token as a decode step does).
    In float32, rounded to x's dtype at the end. Modes: OFFSET_RMS (x * rsqrt(mean(x^2) + eps) * (1 + weight):
    Qwen3.5's norms), GATED_RMS (x * rsqrt(mean(x^2) + eps)
    rounded to x's dtype, times weight rounded again, times silu(gate): the DeltaNet's GatedRMSNorm, in its
    rounding order). The gate may be a slice of a wider tensor (the DeltaNet's fused input projection):
    rows of whole heads [..., heads, width], heads of unit stride within a row, rows at any stride. order
    (int64 [heads], with a gate): the output's head j of a token is the norm of its head order[j] (the heads
    in the column order of a GGUF file's projection after: QuantizedWeight.file_order)."""
    width = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    block = triton.next_power_of_2(width)
    gate_rows, heads = _head_rows(x if gate is None else gate)
    assert order is None or (gate is not None and order.shape == (heads,)), (None if order is None else order.shape)
    dependent = pdl.dependent(x.device)  # a programmatic dependent launch (pdl.py)
    _row_norm[(x.numel() // width,)](x, weight, gate_rows, out, x if order is None else order,
                                     width, heads, gate_rows.stride(0), eps, BLOCK=block, MODE=mode,
                                     ORDERED=order is not None, GDC=dependent,
                                     num_warps=min(max(block // 256, 4), 8), launch_pdl=dependent)
    return out


def _head_rows(gate: torch.Tensor) -> tuple[torch.Tensor, int]:
    """gate as [rows, heads, width] with heads at unit stride, copied only where no view gives that, and heads."""
    heads = gate.shape[-2] if gate.dim() > 1 else 1
    if gate.stride(-1) == 1 and (heads == 1 or gate.stride(-2) == gate.shape[-1]):
        try:
            return gate.view(-1, heads, gate.shape[-1]), heads
        except RuntimeError:  # leading dims that no view flattens
            pass
    return gate.contiguous().view(-1, heads, gate.shape[-1]), heads


def silu_mul(gate_up: torch.Tensor, rows8: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection output [..., 2I] (gate first) -> [..., I]. rows8:
    int8_rows.row_buffers to write the result's int8 form to, as int8_rows.quantized_rows would."""
    width = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    q, scales, sums = rows8 or (out, out, out)
    # a row split over programs of SILU_BLOCK values: one program per row ran Qwen3-8B's 12288 values on
    # one SM, 6.5 us per layer (H200 profile)
    _silu_mul[(gate_up.numel() // (2 * width), triton.cdiv(width, SILU_BLOCK))](
        gate_up, out, q, scales, sums, width, BLOCK=SILU_BLOCK, QUANTIZE=rows8 is not None,
        COLS=width if rows8 is not None else 0)
    return out


if triton is not None:
    from .int8_rows import store_quantized

    @triton.jit
    def _add_rms_norm(x, y, weight, total, normed, q, scales, sums, width, eps, BLOCK: tl.constexpr,
                      ADD: tl.constexpr, OFFSET: tl.constexpr, QUANTIZE: tl.constexpr, COLS: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        offsets = row * width + cols
        s = tl.load(x + offsets, mask=inside, other=0.0).to(tl.float32)
        if ADD:
            s = (s + tl.load(y + offsets, mask=inside, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
            tl.store(total + offsets, s, mask=inside)
            s = s.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / width + eps)
        gain = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        if OFFSET:
            gain = 1.0 + gain
        result = (s * inv_rms * gain).to(normed.dtype.element_ty)
        tl.store(normed + offsets, result, mask=inside)
        if QUANTIZE:  # the row's int8 form as quantized_rows computes it from the stored values (COLS: width)
            store_quantized(tl.reshape(result.to(tl.float32), [BLOCK // 256, 16, 16]), q, scales, sums, row, 0,
                            COLS)

    @triton.jit
    def _row_norm(x, weight, gate, out, order, width, heads, gate_stride, eps, BLOCK: tl.constexpr,
                  MODE: tl.constexpr, ORDERED: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the delta rule) and its writes
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # one row a program: nothing long to wait for
        out_row = tl.program_id(0)
        row = out_row  # the input row it normalises
        if ORDERED:
            row = (out_row // heads) * heads + tl.load(order + out_row % heads).to(tl.int32)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        s = tl.load(x + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        s = s * (1.0 / tl.sqrt(tl.sum(s * s, axis=0) / width + eps))
        w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        if MODE == 0:  # OFFSET_RMS
            s = s * (1.0 + w)
        else:  # GATED_RMS: rounded to the dtype before and after the weight, as GatedRMSNorm does
            s = (w * s.to(out.dtype.element_ty).to(tl.float32)).to(out.dtype.element_ty).to(tl.float32)
            gate_at = (row // heads).to(tl.int64) * gate_stride + (row % heads) * width + cols
            g = tl.load(gate + gate_at, mask=inside, other=0.0).to(tl.float32)
            s = s * (g / (1.0 + tl.exp(-g)))
        tl.store(out + out_row * width + cols, s.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul(gate_up, out, q, scales, sums, width, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
                  COLS: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        gate = tl.load(gate_up + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
        result = (gate / (1.0 + tl.exp(-gate)) * up).to(out.dtype.element_ty)
        tl.store(out + row * width + cols, result, mask=inside)
        if QUANTIZE:  # the row's int8 form as quantized_rows computes it from the stored values (COLS: width)
            store_quantized(tl.reshape(result.to(tl.float32), [BLOCK // 256, 16, 16]), q, scales, sums, row,
                            tl.program_id(1) * (BLOCK // 256), COLS)
