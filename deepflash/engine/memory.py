"""Memory plan: bytes by component for a model pair and its settings, and the largest context that fits.

Sizes come from the models' own cost accounting; models can be built on the meta device, so a plan
for a large pair costs no memory and reads no weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafter.features import drafter_window, mirror_format
from ..models.kv_budget import PAGE, pages_of
from ..models.layers import folded_mask_bytes
from ..quant.weight import dequantized_slice_bytes
from .config import EngineConfig
from .steps import commits_aside

TAG_BYTES = 8  # int64 position tag per ring slot
SNAPSHOTS = 8  # hybrid-target states the default prefix-cache budget makes room for (prefix_cache_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    max_ctx: int
    window: int | None
    feature_dtype: str
    parts: dict[str, int]
    host_bytes: int = 0  # host memory besides the device's: the whole context's KV under --kv-budget

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> dict:
        return {"max_ctx": self.max_ctx, "window": self.window, "feature_dtype": self.feature_dtype,
                "parts": self.parts, "total": self.total, "host_bytes": self.host_bytes}

    def table(self) -> str:
        lines = [f"memory plan: max_ctx {self.max_ctx}, feature window {self.window}, features {self.feature_dtype}"]
        lines += [f"  {name:<22} {mib(n):>10.1f} MiB" for name, n in self.parts.items()]
        lines.append(f"  {'total':<22} {mib(self.total):>10.1f} MiB")
        if self.host_bytes:
            lines.append(f"  {'host: target KV':<22} {mib(self.host_bytes):>10.1f} MiB (--kv-budget: every position)")
        return "\n".join(lines)


def mib(n: int) -> float:
    return n / 2**20


def plan_memory(target, drafter, max_ctx: int, config: EngineConfig = EngineConfig(),
                device: torch.device | str = "cpu", shared_device: bool = True) -> MemoryPlan:
    """Bytes by component on `device` (the one the models will run on) of an engine of `config` with a
    context of max_ctx tokens; `target` / `drafter` may live on the meta device."""
    cfg = target.cfg
    mirror, block_size = mirror_format(config.feature_dtype, target.dtype), config.block_size
    item = target.dtype.itemsize
    resident = resident_positions(max_ctx, config)
    parts = {
        "target weights": target.weight_bytes(),
        "target KV cache": target.kv_bytes_per_token() * resident + target.state_bytes(),
        "rope tables": target.rotary.table_bytes(cfg.positions, target.dtype),
    }
    window = None
    width = 0
    block = block_size or (drafter.cfg.block_size if drafter is not None else 1)
    if drafter is not None:
        dcfg = drafter.cfg
        window = drafter_window(max_ctx, config.trained_ctx or dcfg.trained_context_length, config.feat_ring_cap)
        width = len(dcfg.target_layer_ids) * cfg.hidden_size
        ring_row = width * item
        mirror_row = mirror.row_bytes(width)
        same = shared_device and mirror.dtype == target.dtype
        caps = [min(window, dcfg.layer_window(i) or window) + block for i in range(dcfg.num_layers)]
        kv_row = 2 * dcfg.num_kv_heads * dcfg.head_dim * drafter.dtype.itemsize
        parts["drafter weights"] = drafter.weight_bytes()
        parts["rope tables"] += drafter.rotary.table_bytes(cfg.positions, drafter.dtype)
        slots = window + block  # a verify block's spare slots (features.FeatureRing)
        parts["target feature ring"] = slots * (ring_row + TAG_BYTES)
        # block formats also keep the per-channel storage scale and its inverse in bf16 (features.storage_scale)
        scales = 2 * width * 2 if mirror.dtype is None else 0
        parts["drafter mirror"] = 0 if same else slots * (mirror_row + TAG_BYTES) + scales
        # layers of one capacity share a tag ring (drafter.DrafterContext)
        parts["drafter context K/V"] = sum(caps) * kv_row + sum(set(caps)) * TAG_BYTES
    host = 0
    if resident < max_ctx:  # kv_budget.py: every page's key minima and maxima, K/V's size a page
        parts["KV page summaries"] = target.kv_bytes_per_token() * pages_of(max_ctx)
        host = target.kv_bytes_per_token() * pages_of(max_ctx) * PAGE
    parts["workspace"] = _workspace(cfg, item, resident, min(config.chunk, max_ctx), block, width)
    if dequantized := dequantized_slice_bytes(target, item):  # a prefill projection by a quantized weight
        parts["dequantized weight slice"] = dequantized
    parts["token counts"] = cfg.vocab_size * 5  # the penalties' int32 output counts and bool prompt set
    aside = drafter is not None and commits_aside(torch.device(device).type == "cuda", shared_device)
    parts["cuBLAS workspaces"] = blas_workspaces(torch.device(device), config.cuda_graphs, aside)
    if config.prefix_cache:
        parts["prefix cache"] = prefix_cache_bytes(target, drafter, max_ctx, config, device)[0]
    return MemoryPlan(max_ctx, window, mirror.name, parts, host)


def resident_positions(max_ctx: int, config: EngineConfig) -> int:
    """Positions of target KV on the device: the context's, or the KV budget where it is smaller."""
    return min(max_ctx, config.kv_budget or max_ctx)


def prefix_cache_bytes(target, drafter, max_ctx: int, config: EngineConfig,
                       device: torch.device | str) -> tuple[int, int]:
    """The prefix cache's (device, host) budgets. Device, by default: one context's worth, i.e. the KV and
    tap features of max_ctx positions, so that a whole conversation stays cached while another runs, and for
    a hybrid target room for SNAPSHOTS states (one per conversation end or prefill chunk it resumes at: a
    Qwen3.5-27B snapshot is ~150 MB, one per chunk along the context would outweigh its KV). Host, by
    default: four times that, at most a quarter of the host's memory, on a CUDA device (none on the CPU,
    whose device memory is the host's)."""
    if config.prefix_cache_mb is not None:
        on_device = int(config.prefix_cache_mb * 2**20)
    else:
        per_token = target.kv_bytes_per_token()
        if drafter is not None:
            per_token += target.feature_bytes_per_token(len(drafter.cfg.target_layer_ids), target.dtype)
        on_device = per_token * max_ctx + SNAPSHOTS * target.state_bytes() // 2  # state_bytes counts two copies
    if config.prefix_cache_host_mb is not None:
        return on_device, int(config.prefix_cache_host_mb * 2**20)
    if torch.device(device).type != "cuda":
        return on_device, 0
    import os

    host_memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return on_device, min(4 * on_device, host_memory // 4)


def blas_workspaces(device: torch.device, cuda_graphs: bool, aside: bool) -> int:
    """cuBLAS keeps one workspace per stream it runs on, allocated from torch's caching allocator:
    32 MiB on Hopper (compute capability 9), else torch's default of 2 x 4 MiB + 8 x 16 KiB
    (CUBLAS_WORKSPACE_CONFIG, which deepflash does not read, changes both). The engine runs on the
    current stream, with CUDA graphs also on one warm-up and one capture stream (graphs.py), and with
    a drafter on its device on the stream verify steps commit their features on (`aside`, engine/steps.py)."""
    if device.type != "cuda":
        return 0
    each = 32 * 2**20 if torch.cuda.get_device_capability(device)[0] == 9 else 2 * 4 * 2**20 + 8 * 16 * 2**10
    return each * ((3 if cuda_graphs else 1) + aside)


def _workspace(cfg, item: int, max_ctx: int, chunk: int, block: int, width: int) -> int:
    """Peak transient bytes: the larger of a prefill chunk and a verify step (CUDA attention kernels
    do not materialise scores; the folded mask, layers.forward_mask, is G * T x kv_len)."""
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.num_experts_per_tok, 1))
    per_token = (8 * cfg.hidden_size + 3 * inter + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) * item
    # features are captured per tap, concatenated, then stored and decoded as float32 for the drafter
    per_token += width * (2 * item + 8)
    groups = cfg.num_heads // cfg.num_kv_heads
    prefill = chunk * per_token + folded_mask_bytes(chunk, max_ctx, groups, item) + cfg.vocab_size * 4
    # verify: logits, float32 adjusted scores, float64 uniforms and float32 gumbel noise over the vocabulary,
    # and with penalties the rows' int32 counts (one-hot, running sum, sum), a bool mask and float32 scores
    verify = block * (per_token + cfg.vocab_size * (item + 4 + 8 + 4 + 8 + 17))
    verify += folded_mask_bytes(block, max_ctx, groups, item)
    return max(prefill, verify)


def free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_max_ctx(target, drafter, budget: int, config: EngineConfig, device: torch.device | str) -> int:
    """The largest context (up to the model's) whose plan fits in `budget` bytes; binary search, since
    every component grows with the context."""
    lo, hi = 2, target.cfg.positions
    if plan_memory(target, drafter, lo, config, device).total > budget:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan_memory(target, drafter, mid, config, device).total <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
