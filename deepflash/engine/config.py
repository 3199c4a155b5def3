"""EngineConfig: every setting that decides how a model pair is loaded and run, in one object.

`generate`, `serve`, `info` and the benchmarks build one (engine.runtime.engine_config from the command
line) and everything downstream reads it: the loader, the memory plan and the Engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UserError

DTYPES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "f16": "float16"}
SPEC_MODES = ("auto", "on", "off")
RING_CAP_ENV = "DEEPFLASH_FEAT_RING_CAP"
DEFAULT_PREFILL_CHUNK = 1024
MIN_FITTED_CHUNK = 64  # the smallest chunk fit_prefill_chunk tries


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path, .gguf, hub id; None = the embedded default
    draft: str | None = None  # None = the default drafter of the embedded model, if any
    no_draft: bool = False
    block_size: int | None = None  # verify block; None = the drafter's
    device: str = "auto"
    dtype: str = "auto"
    max_ctx: int | str | None = None  # tokens, "auto" (largest that fits the device), None = the model's
    feature_dtype: str = "auto"  # the drafter mirror's storage: auto (the target's dtype) or a row_formats.FORMATS name
    feat_ring_cap: int | None = None  # the memory valve: lowers the feature window (drafter.features)
    trained_ctx: int | None = None  # the drafter's trained window; None = its config's
    spec: str = "auto"  # speculation policy (engine.controller): auto, on, off
    reserve_mb: int = 1024  # device memory --max-ctx auto leaves free
    ring_kernels: str = "auto"  # feature-ring encode/decode: auto (Triton on CUDA), torch, triton
    target_kernels: str = "auto"  # auto (Triton on CUDA), torch or triton: TargetModel.use_kernels
    rope_scaling: str | None = None  # 'yarn:FACTOR': positions past the model's native window (ModelConfig)
    gguf_weights: str = "auto"  # a GGUF target's matrices: auto, quantized, dequantized (loading.targets.keeps_quantized)
    quantize: str | None = None  # int8 / int4: a Hugging Face target's matrices quantized at load (quant/quantize.py)
    # prompt tokens per prefill forward (a power of two); None: DEFAULT_PREFILL_CHUNK, which load_runtime halves
    # where the memory plan would not fit the device (runtime.fit_prefill_chunk)
    prefill_chunk: int | None = None
    # positions of target KV kept on the device, the rest in host memory, chosen by relevance (models/kv_budget.py);
    # lossy, so None (every position on the device) by default
    kv_budget: int | None = None
    cuda_graphs: bool = True  # decode steps as CUDA graphs (CUDA only)
    prefix_cache: bool = False  # reuse KV, states and features across requests (engine/prefix_cache.py; serve: on)
    prefix_cache_mb: float | None = None  # its device memory; None = one context's worth (memory.prefix_cache_bytes)
    prefix_cache_host_mb: float | None = None  # host memory blocks move to before they are dropped; None = auto
    prefix_block: int = 256  # tokens per prefix-cache block

    @property
    def chunk(self) -> int:
        """The prefill chunk in tokens (prefill_chunk, else the default)."""
        return self.prefill_chunk or DEFAULT_PREFILL_CHUNK

    def validated(self) -> EngineConfig:
        from ..drafter.features import RING_KERNELS
        from ..loading.targets import GGUF_WEIGHTS
        from ..quant.quantize import QUANTIZE
        from ..kernels.row_formats import FORMATS
        from ..models.base import TARGET_KERNELS

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UserError(f"--dtype must be auto or one of {', '.join(sorted(set(DTYPES)))}, got {self.dtype!r}")
        if self.feature_dtype != "auto" and self.feature_dtype not in FORMATS:
            raise UserError(f"--feature-dtype must be auto or one of {', '.join(FORMATS)}, got {self.feature_dtype!r}")
        if self.spec not in SPEC_MODES:
            raise UserError(f"--spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")
        if self.block_size is not None and self.block_size < 1:
            raise UserError(f"--block-size must be >= 1, got {self.block_size}")
        if isinstance(self.max_ctx, str) and self.max_ctx != "auto":
            raise UserError(f"--max-ctx must be a number of tokens or 'auto', got {self.max_ctx!r}")
        if isinstance(self.max_ctx, int) and self.max_ctx < 2:
            raise UserError(f"--max-ctx must be at least 2, got {self.max_ctx}")
        if self.ring_kernels not in RING_KERNELS:
            raise UserError(f"--ring-kernels must be one of {', '.join(RING_KERNELS)}, got {self.ring_kernels!r}")
        if self.target_kernels not in TARGET_KERNELS:
            raise UserError(f"--target-kernels must be one of {', '.join(TARGET_KERNELS)}, got {self.target_kernels!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise UserError(f"GGUF weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise UserError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.trained_ctx is not None and self.trained_ctx < 1:
            raise UserError(f"--trained-ctx must be >= 1, got {self.trained_ctx}")
        if self.prefill_chunk is not None and (self.prefill_chunk < 1 or self.prefill_chunk & (self.prefill_chunk - 1)):
            raise UserError(f"the prefill chunk must be a power of two, got {self.prefill_chunk}")
        for name in ("prefix_cache_mb", "prefix_cache_host_mb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise UserError(f"--kv-budget must be a number of tokens >= 1, got {self.kv_budget}")
        if self.kv_budget is not None and self.prefix_cache:
            raise UserError("--kv-budget and the prefix cache do not run together (the prefix cache saves and "
                            "restores whole-context KV); leave one of them out")
        if self.prefix_block < 1:
            raise UserError(f"the prefix-cache block must be at least 1 token, got {self.prefix_block}")
        return self


def ring_cap_from_env() -> int | None:
    """DEEPFLASH_FEAT_RING_CAP, the memory valve's environment form (--feat-ring-cap wins over it)."""
    value = os.environ.get(RING_CAP_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{RING_CAP_ENV} must be an integer, got {value!r}") from None


def context_length(max_ctx: int | str | None, model_positions: int) -> int:
    """The engine's context in tokens: max_ctx, or the model's whole range (ModelConfig.positions) when
    None. Past that range the model's positions are undefined: an error, not a silent cap."""
    if max_ctx is None:
        return model_positions
    if isinstance(max_ctx, str):
        raise ValueError("max_ctx 'auto' is resolved from the free memory first (engine.runtime.load_runtime)")
    if max_ctx > model_positions:
        raise UserError(f"--max-ctx {max_ctx} is more than the model supports: {model_positions} positions "
                        "(max_position_embeddings, or its YaRN range); lower it, leave it out to use them all, or "
                        "stretch the rope with --rope-scaling yarn:FACTOR")
    return max_ctx
