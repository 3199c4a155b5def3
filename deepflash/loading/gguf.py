"""GGUF files: an HF-style folder (config and tokenizer) written once per file, and the file's tensors read at each
load, matrices kept in their quantized blocks or dequantized."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..errors import UserError
from ..progress import progress
from ..quant.gguf_blocks import FORMATS, block_format, dequantize
from ..quant.experts import ExpertBlocks, GateUp, dequantized
from ..quant.weight import QuantizedWeight
from .gguf_names import HfTensor, hf_config, hf_tensor, join_parts

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def cache_root() -> Path:
    """DEEPFLASH_CACHE, else $XDG_CACHE_HOME/deepflash, else ~/.cache/deepflash."""
    env = os.environ.get("DEEPFLASH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepflash"


def gguf_folder(path: Path) -> Path:
    """An HF-style folder for a GGUF file in the cache, written once: config.json from its metadata and its
    tokenizer. The weights stay in the file (gguf_state reads them at each load).

    Processes that open the same file at once each write into their own temporary folder and rename it
    into place; the folder only ever appears complete, and whoever renames second keeps the first one's (a
    shared temporary folder let one process delete the other's files, 2026-11-30)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file() and not (folder / "model.safetensors").is_file():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_header(path, tmp)
        if folder.is_dir():
            shutil.rmtree(folder)  # left incomplete, or converted by an older version (model.safetensors)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _read_gguf(path: Path):
    """The file's GGUFReader; a file that is not one (text, truncated, corrupt) is the user's error."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, EOFError) as err:
        raise UserError(f"{path} is not a readable GGUF file ({err})") from None


def float_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes of the file's tensors converted to `dtype` (its header alone is read)."""
    return sum(int(np.prod(t.shape)) for t in _read_gguf(path).tensors) * dtype.itemsize


def _write_header(path: Path, out: Path) -> None:
    reader = _read_gguf(path)
    # the tokenizer's arrays are read by _save_gguf_tokenizer; its scalars (bos/eos ids) go to the config
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_token_id")}
    config = hf_config(meta, {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if "tokenizer.ggml.model" in reader.fields:
        _save_gguf_tokenizer(path, out)


def gguf_state(path: Path, config: dict, device, dtype: torch.dtype, quantized: bool
               ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The file's tensors under HF names (gguf_names.hf_tensor, its inverse transforms applied) on `device`:
    with `quantized`, matrices in a supported block format (quant/gguf_blocks.py) stay in their blocks as
    QuantizedWeight; everything else is dequantized to `dtype` (on the device, by our torch dequantizer; the
    gguf package's numpy one for the types we cannot keep). On the meta device nothing is read (memory
    plans). A type we cannot keep quantized is refused when `quantized`, naming the way out."""
    reader = _read_gguf(path)
    state: dict[str, torch.Tensor | QuantizedWeight] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for t in progress(reader.tensors, f"loading {path.name}"):
        target = hf_tensor(t.name, config)
        if target is None:
            continue
        value = _tensor(t, target, torch.device(device), dtype, quantized)
        if target.part is None:
            state[target.name] = _gate_up(value) if target.name.endswith("gate_up_proj") else value
        else:
            parts.setdefault(target.name, {})[target.part] = value
    quantized_parts = {name: p for name, p in parts.items() if all(isinstance(v, ExpertBlocks) for v in p.values())}
    state.update({name: GateUp(p[0], p[1]) for name, p in quantized_parts.items()})
    dense_parts = {name: {i: dequantized(v, dtype) for i, v in p.items()} for name, p in parts.items()
                   if name not in quantized_parts}
    state.update(join_parts(dense_parts))
    return state


def _gate_up(value):
    """A fused expert gate/up tensor ([E, 2I, ...]: gate rows first) kept in blocks as its two halves."""
    if not isinstance(value, ExpertBlocks):
        return value
    inner = value.blocks.shape[1] // 2
    return GateUp(value.rows(0, inner), value.rows(inner, 2 * inner))


def _tensor(t, target: HfTensor, device: torch.device, dtype: torch.dtype, quantized: bool):
    fmt = block_format(t.tensor_type)
    if quantized and fmt is None and t.tensor_type not in FLOAT_TYPES:
        raise UserError(f"GGUF tensor {t.name} is {t.tensor_type.name}, which is not kept quantized (supported: "
                        f"{', '.join(f.name for f in FORMATS.values())}); load it with --dequantize")
    shape = tuple(int(n) for n in reversed(t.shape))
    # an expert stack keeps its blocks where the transform leaves it as stored (qwen3moe, qwen35moe)
    keep = quantized and fmt is not None and target.values is None and target.shape is None
    if keep and len(shape) == 3 and target.rows is None and target.columns is None:
        return ExpertBlocks(fmt, _raw(t, device))
    # a matrix whose transform moves whole rows (or reorders its input features) keeps its blocks
    if keep and len(shape) == 2:
        blocks = _raw(t, device)
        if target.rows is not None:
            blocks = blocks.index_select(0, target.rows.to(device))
        columns = None if target.columns is None else target.columns.to(device)
        return QuantizedWeight([(fmt, blocks)], shape[1], dtype, columns=columns)
    if device.type == "meta":
        return target.apply(torch.empty(shape, dtype=dtype, device=device))
    if fmt is not None:
        dense = dequantize(_raw(t, device), fmt)
    elif t.tensor_type in FLOAT_TYPES:
        dense = _raw(t, device)
        dense = dense.view(torch.bfloat16) if t.tensor_type == GGMLQuantizationType.BF16 else dense
    else:  # IQ*, TQ*, ...: the gguf package's numpy reference, on the host
        from gguf.quants import dequantize as numpy_dequantize

        dense = torch.from_numpy(numpy_dequantize(t.data, t.tensor_type).copy()).to(device)
    return target.apply(dense.float()).to(dtype)


def _raw(t, device: torch.device) -> torch.Tensor:
    """The tensor's stored elements (blocks as uint8) copied from the memory-mapped file to `device` (a copy
    on the host first: a tensor on the read-only mapping would alias the file)."""
    if device.type == "meta":
        return torch.empty(t.data.shape, dtype=torch.uint8, device=device)
    return torch.from_numpy(np.array(t.data)).to(device)


def _save_gguf_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))

