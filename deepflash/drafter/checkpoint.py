"""Drafter checkpoints in the z-lab format: save, load (bf16 or int8 rows), and the pair check."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import NotFound, UserError
from ..models.config import ModelConfig
from .config import DrafterConfig
from .model import DFlashDrafter

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
    from ..loading.weights import hub_snapshot

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
    from ..loading.weights import safetensors_files

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

