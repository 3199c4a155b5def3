"""The DFlash drafter (REFERENCE 1) and its per-layer context K/V cache.

The drafter has no embedding or LM head of its own: a block [last token, MASK x (B-1)] is embedded with
the target's table, runs through a few Qwen3-style layers whose attention also sees the fused target
features ("context") as extra keys/values, and is projected with the target's lm_head. Output k of the
block proposes the token at position start + k (same-position, not shifted); drafts are argmaxes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .argmax_kernel import argmax
from .config import DrafterConfig, ModelConfig
from .errors import NotFound, UserError
from .models.layers import (MLP, FusedProjections, Pending, RMSNorm, Rotary, apply_rotary, attention, embedding_rows,
                            final_norm, fold_mask, fuse_linears, norm_linear, output_projection)


@dataclass
class RingBlock:
    """A draft's layer on the target's Triton kernels (DrafterLayer.ring_forward), its attention on the
    decode-attention kernel (models/decode_kernel.py), which splits the keys over many programs: SDPA
    gave each kv head's 48 folded block queries one program over the whole context (~130 us per layer at
    5.8K tokens, BENCHMARKS.md, sixteenth session). The block's K/V go into the context ring at their
    positions' slots (spare ones: DrafterContext's slack; the verify's append overwrites them), and every
    block query sees slots 0..the block's last position. Only where position p sits in slot p and the
    window holds every position below the span, for bidirectional full-attention layers
    (DrafterContext.masks decides)."""
    k_ring: torch.Tensor  # [1, Hkv, cap, D]: the layer's whole ring (the kernels read it by stride)
    v_ring: torch.Tensor
    slots: torch.Tensor  # the block's positions
    last: torch.Tensor  # [T]: the block's last position, for each query
    span: int  # slots the kernel considers


def attend(q, ctx_k, ctx_v, k, v, mask):
    """Block queries q [b, H, T, D] over keys [context, block]: with an explicit mask already folded for
    SDPA (fold_mask, as DrafterContext.masks gives them), or in training on CUDA a flex_attention
    BlockMask, or in training's SDPA path query chunks (train/chunks.py), which never score the other
    blocks' keys. (A RingBlock layer attends in DrafterAttention.ring_forward.)"""
    if isinstance(mask, torch.Tensor):
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        return attention(q, keys, values, mask)
    from .train.chunks import ChunkedMask, chunked_attend
    from .train.flex import flex_attend

    if isinstance(mask, ChunkedMask):
        return chunked_attend(q, ctx_k, ctx_v, k, v, mask)
    return flex_attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """q, k and v as one GEMM (fuse_linears), the context rows' k and v as one: inference only,
        drafters in training stay unfused."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def keys_values(self, x, cos, sin):
        """K (k_norm, rope at its own positions) and V of rows x [b, n, H] -> [b, Hkv, n, D] each."""
        if self.qkv is None:
            return self._keys_values(self.k_proj(x), self.v_proj(x), cos, sin)
        return self._keys_values(*F.linear(x, self._kv_weight()).chunk(2, dim=-1), cos, sin)

    def write_ring(self, x, cos, sin, slots, k_ring, v_ring) -> None:
        """keys_values of rows x [1, n, H] written to ring slots [n] on the Triton kernel: k_norm, rope and
        both writes as one rope_and_write with no query heads, where torch's form ran ~7 kernels."""
        from .models.rope_kernel import rope_and_write

        rope_and_write(F.linear(x, self._kv_weight()), cos, sin, slots, k_ring, v_ring, 0, self.kv_heads,
                       self.k_norm.weight, self.k_norm.weight, self.k_norm.eps)

    def _kv_weight(self) -> torch.Tensor:
        return self.qkv[0][self.heads * self.head_dim :]  # rows of k, then v: one slice, no copy

    def _keys_values(self, k, v, cos, sin):
        b, n, _ = k.shape
        k = apply_rotary(self.k_norm(k.view(b, n, self.kv_heads, self.head_dim)), cos, sin)
        return k.transpose(1, 2), v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Queries from the block only; keys/values = [context, block] (KV injection)."""
        b, t, _ = x.shape
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv_rows = self.kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv[0]).split([self.heads * self.head_dim, kv_rows, kv_rows], dim=-1)
        q = apply_rotary(self.q_norm(q.view(b, t, self.heads, self.head_dim)), cos, sin)
        k, v = self._keys_values(k, v, cos, sin)
        out = attend(q.transpose(1, 2), ctx_k, ctx_v, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def ring_forward(self, qkv, cos, sin, ring: RingBlock):
        """forward on the Triton kernels from the fused q/k/v projection's output (DrafterLayer.
        ring_forward projects inside its norm's kernel): q/k norms, rope and the block's K/V write into
        the ring as one kernel (models/rope_kernel.py, where torch ran ~12 per layer), then the decode
        attention over slots 0..the block's last position. Fused projections only (load_drafter's form)."""
        from .models.decode_kernel import decode_attention
        from .models.rope_kernel import rope_and_write

        b, t, _ = qkv.shape
        q = rope_and_write(qkv, cos, sin, ring.slots, ring.k_ring, ring.v_ring, self.heads,
                           self.kv_heads, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = decode_attention(q, ring.k_ring, ring.v_ring, ring.last, ring.span)
        return output_projection(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x: the block's hidden rows, or a RingBlock layer's Pending output."""
        if isinstance(mask, RingBlock):
            return self.ring_forward(x, cos, sin, mask)
        if isinstance(x, Pending):
            x = x.residual + x.delta
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def ring_forward(self, x, cos, sin, ring: RingBlock):
        """On the target's Triton kernels, in llama.DecoderLayer.fused_forward's form: each residual add
        and norm inside the projection after it, silu(gate) * up inside the down projection; hands on a
        Pending output."""
        x, qkv = norm_linear(self.input_layernorm, x, *self.self_attn.qkv)
        attn = self.self_attn.ring_forward(qkv, cos, sin, ring)
        x, gate_up = norm_linear(self.post_attention_layernorm, Pending(x, attn), *self.mlp.gate_up)
        return Pending(x, self.mlp.down(gate_up))


class DFlashDrafter(FusedProjections):
    """Parameter names are the z-lab checkpoint names (no `model.` prefix, no embed / lm_head). Loaded for
    inference its projections are fused (load_drafter); trained, they are not."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n_taps = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated tap-layer features [..., n_taps * H] -> context rows [..., H], shared by all layers."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V of fused rows ctx [b, n, H] at absolute positions [n]."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, x, positions, ctx_kv, masks) -> torch.Tensor:
        """x [b, T, H] block embeddings at positions [T]; ctx_kv and masks per layer. Returns normed hidden."""
        cos, sin = self.rotary(positions, x.dtype)
        for layer, (k, v), mask in zip(self.layers, ctx_kv, masks):
            x = layer(x, cos, sin, k, v, mask)
        return final_norm(self.norm, x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def block_embeddings(self, embed: nn.Module, block: torch.Tensor) -> torch.Tensor:
        x = embedding_rows(embed, block).to(self.dtype)
        scale = self.cfg.input_embedding_scale
        return x * scale if scale != 1.0 else x

    # --- cost accounting -------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def context_kv_bytes_per_token(self) -> int:
        cfg = self.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Visibility of block keys to block queries (both absolute positions): bidirectional, or causal,
    limited to |q - k| < window for sliding layers (the reference's rule)."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible


class DrafterContext:
    """Each drafter layer's K/V of the committed context, in a position-tagged ring (slot = pos % cap).

    Full-attention layers see the last `window` committed positions (the feature window), sliding layers
    only their attention window. Rows are appended for every verified position, committed or not (fixed
    shapes, no host sync); `slack` spare slots keep the not-yet-committed rows from evicting visible ones,
    and the masks only admit positions below the block start, so only committed context is ever seen.
    The block's own K/V is computed per draft and never stored.
    """

    def __init__(self, drafter: DFlashDrafter, window: int, slack: int = 0, kernels: str = "torch"):
        """kernels: 'triton' drafts full bidirectional layers on the target's Triton kernels (RingBlock)
        where their ring allows it, and writes the context K/V with them (append), 'torch' always on
        torch's, with SDPA."""
        if kernels == "triton" and not drafter.fused:
            raise ValueError("a drafter drafts on Triton kernels in its fused form (load_drafter's)")
        cfg = drafter.cfg
        self.drafter = drafter
        self.window = window
        self.kernels = kernels
        self.caps = [min(window, cfg.layer_window(i) or window) + slack for i in range(cfg.num_layers)]
        dev, dt = drafter.device, drafter.dtype
        self.k = [torch.zeros((1, cfg.num_kv_heads, cap, cfg.head_dim), device=dev, dtype=dt) for cap in self.caps]
        self.v = [torch.zeros_like(k) for k in self.k]
        # layers of one capacity hold the same positions: they share one tag ring, and their masks
        self.tag_rings = {cap: torch.full((cap,), -1, dtype=torch.int64, device=dev) for cap in self.caps}

    @property
    def tags(self) -> list[torch.Tensor]:
        """Each layer's tag ring (shared by the layers of one capacity)."""
        return [self.tag_rings[cap] for cap in self.caps]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v)) + sum(t.nbytes for t in self.tag_rings.values())

    def reset(self) -> None:
        for tags in self.tag_rings.values():
            tags.fill_(-1)

    def append(self, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Features [n, F] of consecutive positions [n] -> fused -> each layer's K/V, scattered to its ring."""
        rows = self.drafter.fuse(features)[None]
        # a run longer than a ring keeps its newest rows
        kept = {cap: positions[-min(positions.shape[0], cap):] for cap in self.tag_rings}
        slots = {cap: run % cap for cap, run in kept.items()}
        if self.kernels == "triton":
            tables = {cap: self.drafter.rotary(run, rows.dtype) for cap, run in kept.items()}
            for i, layer in enumerate(self.drafter.layers):
                cap = self.caps[i]
                layer.self_attn.write_ring(rows[:, -kept[cap].shape[0]:], *tables[cap], slots[cap], self.k[i],
                                           self.v[i])
        else:
            for i, (k, v) in enumerate(self.drafter.context_kv(rows, positions)):
                cap = self.caps[i]
                keep = kept[cap].shape[0]
                self.k[i].index_copy_(2, slots[cap], k[:, :, -keep:])
                self.v[i].index_copy_(2, slots[cap], v[:, :, -keep:])
        for cap, tags in self.tag_rings.items():
            tags.index_copy_(0, slots[cap], kept[cap])

    def rebuild(self, start: int, features: torch.Tensor) -> None:
        """Start over from the mirror's context rows for [start, start + n) (window change, restore,
        drafter swap)."""
        self.reset()
        if features.shape[0]:
            self.append(torch.arange(start, start + features.shape[0], device=self.drafter.device), features)

    def masks(self, q_pos: torch.Tensor, span: int | None = None) -> list[torch.Tensor | RingBlock]:
        """Per layer the attention mask of a block at positions q_pos, folded for `attention` (fold_mask:
        additive, [groups * size, slots + size]): the committed context positions in [start - window,
        start) that the query may see (sliding: q - p < W), then the block's own keys. Layers alike
        (capacity, window, causality) share one mask. slots: see `kv`. With Triton kernels a layer that
        can draft on the decode kernel gets a RingBlock instead (_on_kernel)."""
        cfg = self.drafter.cfg
        groups = cfg.num_heads // cfg.num_kv_heads
        made: dict[tuple, torch.Tensor] = {}
        out = []
        on_kernel = [self._on_kernel(i, span) for i in range(cfg.num_layers)]
        # each query's last visible key, for RingBlock; the kernel reads positions by index: no stride-0 view
        last = q_pos[-1:].repeat(q_pos.shape[0]) if any(on_kernel) else None
        for i, (cap, slots) in enumerate(zip(self.caps, self._slots(span))):
            if on_kernel[i]:
                out.append(RingBlock(self.k[i], self.v[i], q_pos, last, span))
                continue
            key = (cap, cfg.layer_window(i), cfg.layer_is_causal(i))
            if key not in made:
                visible = self._visible(self.tag_rings[cap][:slots], q_pos, *key[1:])
                made[key] = fold_mask(visible, groups, self.drafter.dtype)
            out.append(made[key])
        return out

    def _on_kernel(self, layer: int, span: int | None) -> bool:
        """A RingBlock for this layer: Triton kernels asked for, a bidirectional full-attention layer, and
        a span within the window (below it the ring has not wrapped, so position p sits in slot p, and
        the window holds every position below the block)."""
        cfg = self.drafter.cfg
        return (self.kernels == "triton" and span is not None and span <= self.window
                and cfg.layer_window(layer) is None and not cfg.layer_is_causal(layer))

    def _visible(self, tags: torch.Tensor, q_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
        """Boolean [size, slots + size]: the context slots, then the block's own keys (see masks)."""
        start = q_pos[:1]
        ctx = ((tags < start) & (tags >= start - self.window) & (tags >= 0))[None, :].expand(q_pos.shape[0], -1)
        if window is not None:
            ctx = ctx & (q_pos[:, None] - tags[None, :] < window)
        return torch.cat([ctx, block_mask(q_pos, q_pos, causal, window)], dim=1)

    def kv(self, span: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K/V over its first min(span, cap) slots. span: a bound on the positions ever
        appended since the reset (the engine's KV bucket of the block's end). Below its cap a ring has not
        wrapped, so position p sits in slot p and the slots from span on hold nothing: a short context
        attends over its few slots, not the whole ring (the draft's attention and K/V copies scale with
        it). None: every slot."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v, n in zip(self.k, self.v, self._slots(span))]

    def _slots(self, span: int | None) -> list[int]:
        """Slots each layer attends over: min(span, cap)."""
        return [cap if span is None else min(span, cap) for cap in self.caps]


def drafter_kernels(target_kernels: str, drafter: DFlashDrafter) -> str:
    """The drafter's kernels (DrafterContext): Triton's where the target's are asked to be, and with
    'auto' on CUDA where Triton is installed; torch's for a head dim that is not a power of two, which
    the kernels' tiles cannot take (the target's kernels, which the flag names, are chosen apart)."""
    from .models.rope_kernel import available

    dim = drafter.cfg.head_dim
    auto = drafter.device.type == "cuda" and available()
    wanted = target_kernels == "triton" or (target_kernels == "auto" and auto)
    return "triton" if wanted and dim & (dim - 1) == 0 else "torch"


def propose(drafter: DFlashDrafter, target, context: DrafterContext, block: torch.Tensor,
            q_pos: torch.Tensor, span: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draft tokens for positions q_pos[1:] (argmax) from the block [last, MASK x (size-1)] at q_pos, into
    `out` where given. span: DrafterContext.kv's bound on the context positions."""
    x = drafter.block_embeddings(target.model.embed_tokens, block[None])
    hidden = drafter(x, q_pos, context.kv(span), context.masks(q_pos, span))
    return argmax(drafter.logits(hidden[0, 1:], target.lm_head), out)


# --- checkpoints (z-lab format) ---------------------------------------------------------------------------
# quantization_config.quant_method of a drafter whose matrices are stored as int8 codes, with one float32
# scale per output row beside each (`<name>_scale`); its vectors (norms) keep the file's dtype
INT8_ROWS = "int8-rows"
STORAGES = ("bf16", "int8")


def save_drafter(drafter: DFlashDrafter, folder: Path | str, dtype: torch.dtype = torch.bfloat16,
                 storage: str = "bf16") -> Path:
    """The z-lab format. storage int8: the matrices as int8 rows (about half the bytes: the 25 MB the
    repository ships hold 6 of the embedded target's drafter layers instead of 3), loaded back into the
    compute dtype by load_drafter; other readers of the z-lab format expect bf16 / f32 tensors."""
    if storage not in STORAGES:
        raise UserError(f"drafter storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    config = drafter.cfg.to_hf() | {"torch_dtype": str(dtype)[6:]}
    if storage == "int8":
        state = int8_rows(state)
        config["quantization_config"] = {"quant_method": INT8_ROWS}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def stored_as(spec: str | Path) -> str:
    """How a drafter folder stores its matrices: one of STORAGES."""
    raw = json.loads((resolve_drafter(str(spec)) / "config.json").read_text())
    return "int8" if _quant_method(raw) == INT8_ROWS else "bf16"


def _quant_method(config: dict) -> str | None:
    """config.json's quantization_config.quant_method, None for plain tensors."""
    return (config.get("quantization_config") or {}).get("quant_method")


def int8_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each matrix as symmetric int8 codes with a float32 scale per row (its largest magnitude / 127):
    0.8% relative error on average over the shipped drafter's matrices, -0.4% AL on the CPU
    (BENCHMARKS.md)."""
    out = {}
    for name, w in state.items():
        if w.dim() != 2:
            out[name] = w
            continue
        scale = (w.float().abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        out[name] = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        out[name + "_scale"] = scale
    return out


def from_int8_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scales = {name[: -len("_scale")]: state[name] for name in state if name.endswith("_scale")}
    return {name: w.float() * scales[name][:, None] if name in scales else w
            for name, w in state.items() if not name.endswith("_scale")}


def resolve_drafter(spec: str) -> Path:
    from .weights import hub_snapshot

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"drafter folder {path} has no config.json")
        return path
    if path.exists():
        raise UserError(f"drafter {path} must be a folder with config.json and safetensors")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return hub_snapshot(spec)
    raise NotFound(f"no such drafter: {spec}")


def load_drafter(spec: str | Path, device="cpu", dtype=torch.float32) -> DFlashDrafter:
    from .weights import safetensors_files

    folder = resolve_drafter(str(spec))
    raw = json.loads((folder / "config.json").read_text())
    cfg = DrafterConfig.from_hf(raw)
    state = {}
    for file in safetensors_files(folder):
        state.update(load_file(str(file)))
    method = _quant_method(raw)
    if method == INT8_ROWS:
        state = from_int8_rows(state)
    elif method is not None:
        raise UserError(f"drafter {folder}: quantization {method!r} is not supported (only {INT8_ROWS!r})")
    codes = sorted(name for name, w in state.items() if not w.is_floating_point())
    if codes:
        raise UserError(f"drafter {folder}: integer tensors without scales ({', '.join(codes[:3])}): "
                        f"its config.json needs quantization_config {{\"quant_method\": \"{INT8_ROWS}\"}}")
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg).to(dtype)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise UserError(f"drafter checkpoint {folder} does not match its config: missing {sorted(missing)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    drafter.rotary.reset_buffers(device)
    return drafter.eval().requires_grad_(False).fuse_projections()


def validate_pair(cfg: DrafterConfig, target: ModelConfig, block_size: int | None = None) -> None:
    """Refuse a drafter that was not made for this target, naming the mismatch."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
    if cfg.num_target_layers and cfg.num_target_layers != target.num_layers:
        problems.append(f"trained for a {cfg.num_target_layers}-layer target, this one has {target.num_layers}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask token {cfg.mask_token_id} outside the target's vocabulary of {target.vocab_size}")
    if cfg.vocab_size and cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} != target's {target.vocab_size}")
    if cfg.block_size < 1:
        problems.append(f"block size {cfg.block_size} < 1")
    if block_size is not None and not 1 <= block_size <= cfg.block_size:
        problems.append(f"--block-size {block_size} must be between 1 and the drafter's {cfg.block_size}")
    if problems:
        raise UserError("drafter does not fit this target: " + "; ".join(problems))
