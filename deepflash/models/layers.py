"""Building blocks shared by the target models and the drafter: norms, rotary embeddings, MLPs, MoE."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.config import SHIPPED, KernelConfig, ProjectionTiling
from ..quant.experts import add_shared
from ..quant.weight import QuantizedWeight
from .config import RopeConfig
from .kv_cache import hidden_keys


def embedding_rows(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """embedding(ids) as an indexing gather, which spreads the rows over the GPU: nn.Embedding's
    index_select kernel took 6.6 us for a 16-token block against 1.8 us for one token in the spec step's
    profile (H200). The same rows, bit for bit. A quantized table dequantizes the rows it reads."""
    if isinstance(embedding.weight, QuantizedWeight):
        return embedding.weight.take_rows(ids)
    return embedding.weight[ids]


class RMSNorm(nn.Module):
    """Llama/Qwen3 RMSNorm through torch's fused op: one kernel instead of the eight of the written-out
    form (which casts, squares, averages, adds, rsqrts, multiplies, casts back and scales). Accumulates
    in float32 like transformers; in bf16 it rounds once where transformers rounds twice."""

    offset = False  # the weight scales as it is (OffsetRMSNorm's scales by 1 + weight): fused_norm reads it

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the op is fused only for a gain of x's dtype: under training's autocast bf16 activations meet
        # float32 gains, which took the written-out form (torch warns "Cannot dispatch to fused")
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


@dataclass(frozen=True)
class Pending:
    """A fused layer's output (llama.DecoderLayer.fused_forward): the residual stream and the MLP output
    not yet added to it. The next kernel that adds them (the next layer's input norm, fused into its
    q/k/v projection, or the final norm) writes the sum to `total` when that is given: a feature tap
    names the tensor (`tap`) and reads it after the forward."""

    residual: torch.Tensor
    delta: torch.Tensor
    total: torch.Tensor | None = None


def tap(x: torch.Tensor | Pending, next_norm: nn.Module):
    """A feature tap after a layer: (the layer's residual output, the next layer's input). After a fused
    layer the sum does not exist yet: the tap hands the next layer's kernel an empty tensor to write it
    to, so capturing features adds no kernel and changes no rounding (next_norm: the torch form's)."""
    if not isinstance(x, Pending):
        return x, x
    total = torch.empty_like(x.residual)
    return total, Pending(x.residual, x.delta, total)


def fused_norm(norm: RMSNorm, x: torch.Tensor | Pending, rows8: tuple[torch.Tensor, ...] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed) by the Triton kernel (layer_ops.add_rms_norm) of a layer input that is one
    tensor or a fused layer's Pending output: the pending add runs inside the norm's kernel, and where
    rows8 (QuantizedWeight.int8_buffers) is given, the normed rows' int8 form too."""
    from ..kernels.layer_ops import add_rms_norm  # imports Triton: only where it is used

    residual, delta, total = _parts(x)
    return add_rms_norm(residual, delta, norm.weight, norm.eps, total, norm.offset, rows8)


def _parts(x: torch.Tensor | Pending) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(residual, pending delta, where the sum goes) of a layer input: one tensor has nothing pending."""
    return (x.residual, x.delta, x.total) if isinstance(x, Pending) else (x, None, None)


def norm_linear(norm: RMSNorm, x: torch.Tensor | Pending, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiling: ProjectionTiling = SHIPPED.projections) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, projection of the normed residual) of a fused layer's input: for a decode or verify
    step's few rows one kernel (kernels/gemv.py norm_linear: add, norm and GEMV), else fused_norm's
    kernel and torch's GEMM. A quantized weight projects after fused_norm's kernel (QuantizedWeight.project)."""
    from ..kernels import gemv  # imports Triton: only where it is used

    if isinstance(weight, QuantizedWeight):  # the norm's kernel quantizes the rows to int8 for the projection
        rows8 = weight.int8_buffers(_parts(x)[0])
        residual, hidden = fused_norm(norm, x, rows8)
        return residual, weight.project(hidden, bias, kernels=True, rows8=rows8)
    residual, delta, total = _parts(x)
    if not gemv.fits(residual, weight, tiling):
        residual, hidden = fused_norm(norm, x)
        return residual, F.linear(hidden, weight, bias)
    return gemv.norm_linear(residual, delta, norm.weight, norm.eps, weight, bias, total, tiling, norm.offset)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelConfig | None,
                rows8: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x @ weight.T + bias: with the kernels on, for a decode or verify step's few rows kernels/gemv.py
    linear, which gives a row the same bits whatever the number of rows (cuBLAS picks other kernels for 1
    and 16 rows, so a verify step would round its tokens unlike decode steps); else torch's GEMM. A
    quantized weight projects itself (QuantizedWeight.project; rows8: x's int8 form, written already)."""
    if isinstance(weight, QuantizedWeight):
        return weight.project(x, bias, kernels is not None, rows8)
    if kernels is not None:
        from ..kernels import gemv  # imports Triton: only where it is used

        if gemv.fits(x, weight, kernels.projections):
            return gemv.linear(x, weight, bias, kernels.projections)
    return F.linear(x, weight, bias)


def final_norm(norm: RMSNorm, x: torch.Tensor | Pending) -> torch.Tensor:
    """The stack's final norm, adding a fused layer's pending MLP output in the same kernel."""
    return fused_norm(norm, x)[1] if isinstance(x, Pending) else norm(x)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the rotated part of a head and the cos/sin scale (YaRN's attention factor)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3_frequencies(rope, inv_freq), 1.0
    return _yarn_frequencies(rope, dim, inv_freq)


def _llama3_frequencies(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(rope: RopeConfig, dim: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)
    original = rope.original_max_position

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention)


class Rotary(nn.Module):
    """cos/sin tables for explicit positions; computed in float32 like transformers, then cast."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.reset_buffers()
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 table; called again after a model is materialised from the meta device."""
        inv_freq, self.scaling = rope_frequencies(self.rope, self.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for apply_rotary: the sin's first half is negated once here, so that each
        rotation is a roll and a multiply-add (3 kernels per tensor instead of 5). From the tables where
        `tabulate` made them (positions must lie below their length), else computed."""
        if self.cos_table is not None and self.cos_table.dtype == dtype:
            return self.cos_table[positions], self.sin_table[positions]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def tabulate(self, count: int, dtype: torch.dtype) -> None:
        """Compute the tables of positions [0, count) once, in `dtype`: each forward then gathers its rows
        (2 kernels where computing them took 11, per decode step). Made once for the module's life and
        never replaced, since captured CUDA graphs read them: every engine asks for the model's whole
        position range."""
        if self.cos_table is None:
            self.cos_table, self.sin_table = self._compute(torch.arange(count, device=self.inv_freq.device), dtype)
        elif self.cos_table.shape[0] != count or self.cos_table.dtype != dtype:
            raise ValueError(f"rope tables exist for {self.cos_table.shape[0]} positions in {self.cos_table.dtype}, "
                             f"not {count} in {dtype}")

    def table_bytes(self, count: int, dtype: torch.dtype) -> int:
        return 2 * count * 2 * self.inv_freq.numel() * dtype.itemsize


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on the first cos.shape[-1] dims of x [..., T, H, D] (tables [T, rot] from Rotary):
    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, rot/2) * signed_sin."""
    rot = cos.shape[-1]
    cos, signed_sin = cos[..., None, :], signed_sin[..., None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, dims=-1), signed_sin)
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


def read_by_torch_gemm(weight: torch.Tensor) -> bool:
    """The weights stored transposed (gemm_layout): on CUDA, those torch's GEMM reads in decode steps, past
    the projection kernels' size (an LM head)."""
    return weight.device.type == "cuda" and not SHIPPED.projections.takes(weight)


def gemm_layout(weight: torch.Tensor, transposed: Callable[[torch.Tensor], bool] = read_by_torch_gemm
                ) -> torch.Tensor:
    """The [N, K] weight, stored as its transpose (strides (1, N): the same values and shape) where
    `transposed` says so. cuBLAS then reads the weight untransposed, which streamed Qwen3-8B's q/k/v,
    gate/up, down and LM head weights 3-8% faster for 1 and 16 rows (H200). Other weights, and one
    already stored so, come back as they are."""
    if weight.dim() != 2 or weight.stride(-1) != 1 or not transposed(weight):
        return weight
    return weight.t().contiguous().t()


def fuse_linears(*linears: nn.Linear, transposed: Callable[[torch.Tensor], bool] = read_by_torch_gemm
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears that read the same input, so that one GEMM replaces
    several: a decode step is bound by kernel launches and weight reads, and one larger GEMV does better
    on both. The linears' parameters become views into the fused tensors, so names, state_dict and
    weight accounting are unchanged and nothing is stored twice. Frozen (inference) models only:
    gradients would reach the fused tensor, not the parameters. The fused weight takes gemm_layout;
    quantized ones join their blocks (QuantizedWeight.cat)."""
    if isinstance(linears[0].weight, QuantizedWeight):
        return _fuse_quantized(linears)
    weight = _joined_rows([m.weight.detach() for m in linears])
    if weight is None or transposed(weight):
        weight = gemm_layout(torch.cat([m.weight.detach() for m in linears]), transposed)
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


def _joined_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The weights as one tensor without a copy where they are already consecutive rows of one (an enclosing
    module fused them first: SharedExpertMoe's members include its shared expert's gate and up), else None. Where
    that tensor is to be stored transposed, fuse_linears copies it instead."""
    first = weights[0]
    at = first.data_ptr()
    for w in weights:
        if (not w.is_contiguous() or w.dtype != first.dtype or w.shape[1:] != first.shape[1:] or w.data_ptr() != at
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        at += w.numel() * w.element_size()
    return first.as_strided((sum(w.shape[0] for w in weights), *first.shape[1:]), first.stride())


def _fuse_quantized(linears) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """fuse_linears for QuantizedLinear members: their blocks joined, each member's weight a view of its rows."""
    weight = QuantizedWeight.cat([m.weight for m in linears])
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = weight.row_slice(row, row + rows)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return weight, bias


class FusedProjections(nn.Module):
    """A frozen model whose submodules' projections that share an input run as one GEMM each (their
    `fuse_projections`, fuse_linears). The fusion survives .to() and friends."""

    fused = False  # set by fuse_projections
    transposed = staticmethod(read_by_torch_gemm)  # which weights gemm_layout stores transposed

    def fuse_projections(self, transposed: Callable[[torch.Tensor], bool] | None = None):
        """Fuse, then give the linears' own large weights gemm_layout (the fused ones have it); an
        embedding's table keeps its rows even where an LM head shares it (tied). `transposed`: which
        weights to store transposed, kept for later fusions (.to()); read_by_torch_gemm by default (tests
        ask for others to check the layout on the CPU)."""
        if transposed is not None:
            self.transposed = transposed
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections(self.transposed)
        tables = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in tables:
                weight = module.weight.detach()
                laid = gemm_layout(weight, self.transposed)
                if laid is not weight:
                    module.weight = nn.Parameter(laid, requires_grad=False)
        self.fused = True
        return self

    def _apply(self, fn, recurse=True):
        """.to() and friends move parameters one by one, which would leave the fused tensors behind on the
        old device or dtype (a forward then fails on mixed devices): fuse them again from the moved
        parameters."""
        super()._apply(fn, recurse)
        return self.fuse_projections() if self.fused else self


class MLP(nn.Module):
    """SwiGLU feed-forward with HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.kernels: KernelConfig | None = None  # Triton's with this tuning, else torch's (use_kernels)

    def fuse_projections(self, transposed: Callable[[torch.Tensor], bool] = read_by_torch_gemm) -> None:
        """gate and up as one GEMM (fuse_linears); trained modules (the drafter in training) stay unfused."""
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj, transposed=transposed)

    def forward(self, x: torch.Tensor, rows8: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """rows8: x's int8 form for a quantized gate/up (QuantizedWeight.int8_buffers), written already."""
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.activated_down(linear_rows(x, *self.gate_up, self.kernels, rows8))

    def activated_down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) of the gate/up projection's output [..., 2I] (gate first): on the Triton
        kernels where they are on (down), else torch's ops."""
        if self.kernels is not None:
            return self.down(gate_up, self.kernels.projections)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def down(self, gate_up: torch.Tensor, tiling: ProjectionTiling = SHIPPED.projections) -> torch.Tensor:
        """down_proj(silu(gate) * up) of the fused gate/up output on the Triton kernels: for a decode or
        verify step's few rows one kernel (kernels/gemv.py silu_linear), else silu_mul's and torch's GEMM
        (a quantized weight: silu_mul's and QuantizedWeight.project)."""
        from ..kernels import gemv
        from ..kernels.layer_ops import silu_mul

        weight, bias = self.down_proj.weight, self.down_proj.bias
        if isinstance(weight, QuantizedWeight):  # silu_mul's kernel quantizes the rows to int8 for the projection
            rows8 = weight.int8_buffers(gate_up[..., : weight.cols])
            return weight.project(silu_mul(gate_up, rows8), bias, kernels=True, rows8=rows8)
        if gemv.fits(gate_up, weight, tiling):
            return gemv.silu_linear(gate_up, weight, bias, tiling)
        return self.down_proj(silu_mul(gate_up))


@functools.cache
def _grouped_mm_device(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10)


class Experts(nn.Module):
    """Routed experts stored fused (transformers 5 layout): gate_up_proj [E, 2I, H], down_proj [E, H, I].

    No path syncs with the host, whatever the routing: decode, verify and prefill steps run as captured
    CUDA graphs. Nor does any copy the routed experts' weights per token."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [N, H]; experts/weights [N, k]: each token's sum of its experts' outputs times their weights, plus
        sigmoid(logits) * output of `shared` (a shared expert's output and gate logits) where given.
        Decode and verify steps on the Triton kernels (kernels/moe.py, which add the shared expert in their
        last kernel), else F.grouped_mm where it serves without a sync, else the dense form."""
        if self.kernels is not None:
            from ..kernels import moe  # imports Triton: only where it is used

            if moe.fits(x, self.gate_up_proj, self.down_proj):
                return moe.routed_experts(x, experts, weights, self.gate_up_proj, self.down_proj, shared)
        if self._grouped_serves(x):
            return add_shared(self._grouped(x, experts, weights), shared)
        return add_shared(self._dense(x, experts, weights), shared)

    def _grouped_serves(self, x: torch.Tensor) -> bool:
        """Whether F.grouped_mm runs these experts without a host sync (torch 2.13): bfloat16 on compute
        capability 9.x or 10.x (H100, H200, B200), where CUTLASS reads the group ends on the device. Elsewhere
        it loops over GEMMs at ends copied to the host (its fallback, the CPU's too), refuses float64, and
        dynamo traces it for bfloat16 only. Its tiles need rows of whole 16 bytes."""
        hidden, inner = self.down_proj.shape[1:]
        return (x.dtype == self.down_proj.dtype == torch.bfloat16 and hidden % 8 == 0 and inner % 8 == 0
                and x.is_cuda and _grouped_mm_device(x.device))

    def _grouped(self, x, experts, weights):
        """The (token, slot) pairs sorted by expert on the device, each expert's run of them multiplied by its
        weights in one grouped GEMM: every routed expert's weights read once, no others."""
        n, k = experts.shape
        routed, order = experts.flatten().sort(stable=True)
        groups = torch.arange(self.gate_up_proj.shape[0], device=x.device)
        ends = torch.searchsorted(routed, groups, right=True, out_int32=True)  # where each expert's pairs end
        gate, up = F.grouped_mm(x[order // k], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        by_expert = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        by_pair = torch.empty_like(by_expert).index_copy_(0, order, by_expert).view(n, k, -1)
        return (by_pair * weights[..., None].to(by_pair.dtype)).sum(1)

    def _dense(self, x, experts, weights):
        """Every expert over every token, an unrouted expert weighted 0: shapes that never depend on the
        routing, where F.grouped_mm would sync. It costs E/k times the routed work and reads every expert's
        weights (16x for Qwen3-30B-A3B's top 8 of 128), with [N, E, 2I] and [E, N, H] intermediates (a
        1024-token prefill piece at that size: 0.4 and 0.5 GB in bfloat16)."""
        n, count = x.shape[0], self.gate_up_proj.shape[0]
        gate, up = F.linear(x, self.gate_up_proj.flatten(0, 1)).view(n, count, -1).chunk(2, dim=-1)
        routing = torch.zeros(n, count, dtype=x.dtype, device=x.device).scatter_(1, experts, weights.to(x.dtype))
        # the weight applied before the down projection (linear): its [E, N, H] products then only add up
        hidden = (F.silu(gate) * up * routing[..., None]).transpose(0, 1)
        return torch.bmm(hidden, self.down_proj.transpose(1, 2)).sum(0)


class Router(nn.Module):
    """Top-k softmax router (Qwen3-MoE): softmax in float32, top-k, optional renormalisation."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def choose(self, logits: torch.Tensor, dtype: torch.dtype, kernels: KernelConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts, weights in `dtype`) of router logits computed by the caller: with the kernels on, one
        kernel (kernels/router.py), else torch's ops."""
        if kernels is not None:
            from ..kernels import router  # imports Triton: only where it is used

            if router.fits(logits):
                return router.route(logits, self.top_k, self.normalize, dtype)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(dtype)


class SparseMoe(nn.Module):
    """Qwen3-MoE block: names mlp.gate (router) and mlp.experts.*, as transformers saves them."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, normalize)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.kernels: KernelConfig | None = None  # Triton's for decode and verify steps, else torch's (use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights = self._route(flat)
        return self.experts(flat, experts, weights).reshape(shape)

    def _route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's (experts, weights) of rows [N, H]. With the kernels on, its logits on kernels/gemv.py
        for a step's few rows (layers.linear_rows: cuBLAS may sum a row's logits apart for 1 and 16 rows, and a
        near tie would then route a verified token unlike a decoded one), and the rest in one kernel."""
        logits = linear_rows(flat, self.gate.weight, None, self.kernels)
        return self.gate.choose(logits, flat.dtype, self.kernels)


def fold_mask(mask: torch.Tensor | None, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean [T, S] or [B, 1, T, S] mask (True: attend) made ready for `attention` once per forward
    and shared by all its layers: repeated for `groups` query heads per K/V head, and additive (0 or
    -inf in `dtype`). SDPA's fused kernels convert a boolean mask to that form on every call, which
    cost three kernels per layer of a decode step."""
    if mask is None:
        return None
    return fold_hidden(~mask, groups, dtype)


def fold_hidden(hidden: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """fold_mask from the mask's complement (True: masked), filled straight into the folded [..., G * T, S]
    form through the complement broadcast over the groups. A repeated boolean copy and its negation had
    made a prefill piece's mask 16 bytes an element, against 9 so (4 groups in bf16; folded_mask_bytes)."""
    *lead, t, s = hidden.shape
    folded = torch.zeros(*lead, groups, t, s, dtype=dtype, device=hidden.device)
    return folded.masked_fill_(hidden.unsqueeze(-3), float("-inf")).view(*lead, groups * t, s)


def folded_mask_bytes(queries: int, kv_len: int, groups: int, item: int) -> int:
    """Peak bytes of forward_mask's mask of a forward of `queries` tokens without a key mask: the boolean
    hidden_keys [T, S] alive while the additive [G * T, S] of `item`-byte elements is filled from it."""
    return queries * kv_len * (1 + groups * item)


CAUSAL = "causal"  # the mask of a forward over the whole key range: SDPA's own causal flag (forward_mask)
DECODE = "decode"  # the mask of a step on the Triton decode-attention kernel, which masks by position itself


def forward_mask(positions: torch.Tensor, kv_len: int, key_mask: torch.Tensor | None, groups: int,
                 dtype: torch.dtype) -> torch.Tensor | str:
    """The attention mask of a target forward, for `attention`. A forward writes the cache slots of its
    positions and sees slots < kv_len, so T == kv_len means positions 0..T-1: without a key mask that is
    plain causal attention, which SDPA's flash kernels do without a mask tensor and skipping the masked
    half (the drafter training's feature pass spent most of its step in masked attention, profile_train
    2026-11-30). Anything else gets the folded explicit mask, built from the positions on the device:
    graph steps replay one capture for every start within their KV bucket (kv_len above the last
    position + 1), so no shape the host picks, such as a lower-right causal triangle, fits them all."""
    if key_mask is None and positions.shape[-1] == kv_len:
        return CAUSAL
    return fold_hidden(hidden_keys(positions, kv_len, key_mask), groups, dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              folded_mask: torch.Tensor | str | None) -> torch.Tensor:
    """SDPA for grouped-query attention with an explicit mask (from fold_mask), or causal (CAUSAL).

    SDPA's fused kernels reject enable_gqa together with a mask and fall back to the math kernel
    (full score matrix, K/V repeated per head). Folding each K/V head's query group into the query
    length instead (q [B, Hkv, G*T, D], the mask repeated G times by fold_mask) is the same computation
    as plain multi-head attention, which the memory-efficient kernel serves with a mask and no K/V copy.
    q [B, H, T, D], k/v [B, Hkv, S, D]."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    if isinstance(folded_mask, str):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    q = q.reshape(b, k.shape[1], groups * t, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=folded_mask).reshape(b, h, t, d)
