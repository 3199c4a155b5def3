"""EngineConfig: everything that decides how a model pair is loaded and run."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

DTYPES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "f16": "float16"}


SPEC_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how a model pair is loaded and run; shared by generate, serve and bench."""

    model: str | None = None  # path, .gguf, hub id; None = the embedded default
    draft: str | None = None  # None = the default drafter of the embedded model, if any
    no_draft: bool = False
    block_size: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_ctx: int | str | None = None  # tokens, "auto" (largest that fits the device), None = the model's
    feature_dtype: str = "f32"
    feat_ring_cap: int | None = None
    trained_ctx: int | None = None
    spec: str = "auto"
    reserve_mb: int = 1024  # device memory --max-ctx auto leaves free
    ring_kernels: str = "auto"  # feature-ring encode/decode: auto, torch, compile, triton (features.py)
    target_kernels: str = "auto"  # auto (Triton on CUDA), torch or triton: TargetModel.use_kernels

    def validated(self) -> EngineConfig:
        from ..drafter.features import RING_KERNELS
        from ..kernels.row_formats import FORMATS
        from ..models.base import TARGET_KERNELS

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UserError(f"--dtype must be auto or one of {', '.join(sorted(set(DTYPES)))}, got {self.dtype!r}")
        if self.feature_dtype not in FORMATS:
            raise UserError(f"--feature-dtype must be one of {', '.join(FORMATS)}, got {self.feature_dtype!r}")
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
        if self.trained_ctx is not None and self.trained_ctx < 1:
            raise UserError(f"--trained-ctx must be >= 1, got {self.trained_ctx}")
        return self

