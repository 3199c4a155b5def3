"""A MoE layer's routing of a decode or verify step in one Triton kernel: the softmax over the router's logits,
the top k, and their renormalisation (layers.Router.choose's torch form runs these as 4-5 kernels a layer, and a
MoE decode step is bound by its launches: scripts/count_launches.py).

One program routes one row, in float32: it computes the softmax as torch does (exp(x - max) / sum), then takes the
k largest probabilities one at a time (ties to the lower expert id), and divides them by their sum where the
model renormalises. A row's experts and weights depend only on its own logits, so a verify step routes each token
as a decode step does. `TRITON_INTERPRET=1` runs it on the CPU for the tests.
"""

from __future__ import annotations

import torch

from . import pdl
from .triton_support import INTERPRETED, tl, triton

MAX_EXPERTS = 1024  # one program holds a row's logits


def fits(logits: torch.Tensor) -> bool:
    return logits.shape[-1] <= MAX_EXPERTS and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)


def route(logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64, in decreasing probability; weights [N, k] in `dtype`) of router logits [N, E] at any
    row stride (a slice of a fused projection's output)."""
    rows, count = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    experts = torch.empty((rows, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((rows, top_k), dtype=dtype, device=logits.device)
    dependent = pdl.dependent(logits.device)  # a programmatic dependent launch (pdl.py)
    _route[(rows,)](logits, experts, weights, logits.stride(0), EXPERTS=count, BLOCK=triton.next_power_of_2(count),
                    TOP_K=top_k, GDC=dependent, launch_pdl=dependent,
                    SLOTS=triton.next_power_of_2(top_k), NORMALIZE=normalize,
                    ROUND=INTERPRETED and dtype == torch.bfloat16)
    return experts, weights


if triton is not None:
    from .quant_gemv import _to_nearest

    @triton.jit
    def _route(logits, experts, weights, row_stride, EXPERTS: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
               SLOTS: tl.constexpr, NORMALIZE: tl.constexpr, ROUND: tl.constexpr, GDC: tl.constexpr):
        if GDC:  # launched as a dependent (pdl.py): wait for the kernel before (the router's projection)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # one row a program: nothing long to wait for
        row = tl.program_id(0).to(tl.int64)
        ids = tl.arange(0, BLOCK)
        x = tl.load(logits + row * row_stride + ids, mask=ids < EXPERTS, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        p = e / tl.sum(e, axis=0)  # padding lanes: exp(-inf) = 0
        p = tl.where(ids < EXPERTS, p, -1.0)  # never chosen
        slots = tl.arange(0, SLOTS)
        chosen = tl.zeros([SLOTS], dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            expert = tl.min(tl.where(p == best, ids, BLOCK), axis=0)
            tl.store(experts + row * TOP_K + i, expert.to(tl.int64))
            chosen = tl.where(slots == i, best, chosen)
            p = tl.where(ids == expert, -1.0, p)
        if NORMALIZE:
            chosen = chosen / tl.sum(chosen, axis=0)
        # rounded to nearest in the interpreter too (ROUND, quant_gemv._to_nearest)
        tl.store(weights + row * TOP_K + slots, _to_nearest(chosen, ROUND).to(weights.dtype.element_ty),
                 mask=slots < TOP_K)
