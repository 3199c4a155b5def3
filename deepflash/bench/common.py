"""Shared benchmark plumbing: device bandwidth, timing, tables, JSON records."""

from __future__ import annotations

import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

stdout = Console()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_seconds(fn, calls: int = 20, replays: int = 10) -> float:
    """Device seconds of one call of fn on CUDA: a graph of `calls` calls, replayed, so the time is the
    kernels' own, without the host's launches between them (for kernels of tens of microseconds, the
    launches from Python may take as long)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / (calls * replays)


def forward_seconds(target, tokens: int, context: int) -> float:
    """Device seconds of the target's forward of `tokens` new tokens after context - tokens cached ones, as a
    CUDA graph (graph_seconds): the target alone, no sampling or host work."""
    device = target.device
    cache = target.new_cache(1, context)
    ids = torch.randint(2, target.cfg.vocab_size, (1, tokens), device=device)
    positions = torch.arange(context - tokens, context, device=device)
    return graph_seconds(lambda: target(ids, positions, cache, context), calls=5, replays=5)


def copy_bandwidth(device: torch.device, megabytes: int = 2048, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (the ceiling the
    brief's MBU figures are relative to)."""
    n = megabytes * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    began = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    seconds = (time.perf_counter() - began) / repeats
    return 2 * src.nbytes / seconds / 1e9


def embedded_pair(device_name: str = "auto"):
    """The embedded target and its tokenizer on a device, in the engine's default dtype for it."""
    from ..engine.runtime import resolve_device, resolve_dtype
    from ..loading.targets import load_target
    from ..loading.tokenizer import load_tokenizer

    device = resolve_device(device_name)
    target, folder = load_target(None, device, resolve_dtype("auto", device))
    return target, load_tokenizer(folder)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def environment(device: torch.device) -> dict:
    import transformers

    # python: the depth and recall prompts are its standard library's modules, so figures pair up only
    # between runs on one Python version
    return {"device": device_name(device), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": date.today().isoformat()}


def table(title: str, columns: list[str], rows: list[list]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for row in rows:
        t.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row])
    stdout.print(t)


def save(record: dict, out: str | None) -> None:
    """Write the record as JSON, if asked: at the end, and by long benches after each part, so that a
    part that fails (a kernel that does not compile for one dtype) does not take the finished ones with it."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=2))


def finish(record: dict, out: str | None) -> dict:
    """Write the record as JSON (if asked) and end stdout with it as one line."""
    save(record, out)
    print(json.dumps(record))
    return record
