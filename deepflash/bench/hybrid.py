"""Hybrid-target step costs: decode, verify and the two rollback paths of the DeltaNet states.

A random-weight model with Qwen3.5-27B's layer pattern (3 Gated DeltaNet : 1 full attention) and head
shapes, scaled down in width and depth, prefills a prompt; then each step is timed (median of `iters`
runs after warm-up): a one-token decode, a verify forward over a block with either rollback path armed,
and keep(n) after a verify, for capture (n a device tensor, as the engine passes it) and replay.
keep(block) is a no-op for replay and a full rebuild for capture (a device n is not read).

Eager steps include Python launch overhead; on CUDA the steps are also captured as CUDA graphs (as the
engine runs them), where a capture-mode keep must share its verify's graph: "verify + keep(n)".

    deepflash bench hybrid --device cuda --out hybrid.json
    deepflash bench hybrid --device cpu --tiny
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

from ..models import random_model
from ..models.config import ModelConfig
from ..models.delta_rule import fla_available
from .common import environment, finish, table

LAYERS = {"full": 16, "tiny": 4}
PATTERN = ["linear_attention"] * 3 + ["full_attention"]


def model_config(tiny: bool) -> ModelConfig:
    """27B: hidden 5120, 64 layers, 24 x 256 attention heads (4 KV), DeltaNet 16 key / 48 value heads of
    128. Here: hidden 2048, 16 layers, the same head dims (so the same per-head state sizes)."""
    layers = LAYERS["tiny" if tiny else "full"]
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, vocab_size=256) if tiny else dict(
                 hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, vocab_size=32768)
    return ModelConfig.from_hf(dict(
        model_type="qwen3_5_text", num_hidden_layers=layers, layer_types=PATTERN * (layers // 4),
        linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25), **shape))


def timed(device: torch.device, fn: Callable[[], None], setup: Callable[[], None] | None = None,
          warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn(); setup() runs before each call, untimed."""
    samples = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            ms = begin.elapsed_time(end)
        else:
            began = time.perf_counter()
            fn()
            ms = (time.perf_counter() - began) * 1e3
        if i >= warmup:
            samples.append(ms)
    return statistics.median(samples)


def graphed(device: torch.device, fn: Callable[[], None]) -> Callable[[], None]:
    """fn captured as a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.no_grad()
def run(device: str = "cuda", json_path: str | None = None, *, tiny: bool = False, prompt: int | None = None,
        block: int = 16, iters: int = 20) -> dict:
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = model_config(tiny)
    model = random_model(cfg, device=device, dtype=dtype)
    prompt = prompt or (32 if tiny else 512)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt + block), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    caches = {mode: model.new_cache(1, prompt + block, rollback=mode) for mode in ("capture", "replay")}
    for cache in caches.values():
        model(tokens[:, :prompt], torch.arange(prompt, device=device), cache, logits="none")
    last = torch.arange(prompt, prompt + 1, device=device)
    span = torch.arange(prompt, prompt + block, device=device)
    count = torch.zeros((), dtype=torch.long, device=device)  # keep()'s n on the device, as the engine has it

    def decode():
        model(tokens[:, prompt : prompt + 1], last, caches["replay"], prompt + 1)

    def verify(mode):
        return lambda: model(tokens[:, prompt : prompt + block], span, caches[mode], prompt + block)

    def keep(mode, n):
        cache = caches[mode]
        return (lambda: cache.keep(count)) if mode == "capture" else (lambda: cache.keep(n))

    def verify_keep(mode, n):
        return lambda: (verify(mode)(), keep(mode, n)())

    kept = (1, block // 2, block - 1, block)
    eager = {"decode": timed(device, decode, iters=iters)}
    for mode in caches:
        eager[f"verify ({mode})"] = timed(device, verify(mode), iters=iters)
    for n, mode in itertools.product(kept, caches):
        eager[f"keep({n}) {mode}"] = timed(device, keep(mode, n), lambda: (count.fill_(n), verify(mode)()),
                                           iters=iters)
    graph = {}
    if device.type == "cuda":  # device time without Python launch overhead, as the engine runs steps
        graph["decode"] = timed(device, graphed(device, decode), iters=iters)
        for mode in caches:
            graph[f"verify ({mode})"] = timed(device, graphed(device, verify(mode)), iters=iters)
        capture_step = graphed(device, verify_keep("capture", None))  # one graph: n is read on the device
        for n in kept:
            graph[f"verify + keep({n}) capture"] = timed(device, capture_step, lambda: count.fill_(n), iters=iters)
            graph[f"verify + keep({n}) replay"] = timed(device, graphed(device, verify_keep("replay", n)),
                                                        iters=iters)
    record = {
        "bench": "hybrid", **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "fla": fla_available(device), "layers": cfg.num_layers, "hidden": cfg.hidden_size, "prompt": prompt,
        "block": block, "iters": iters, "state_mib": model.state_bytes() / 2**20,
        "eager_ms": {k: round(v, 4) for k, v in eager.items()},
        "graph_ms": {k: round(v, 4) for k, v in graph.items()},
    }
    title = f"hybrid target ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {record['dtype']}), prompt {prompt}"
    table(f"{title}: eager steps", ["step", "ms"], [[k, v] for k, v in eager.items()])
    if graph:
        table(f"{title}: CUDA-graph steps", ["step", "ms"], [[k, v] for k, v in graph.items()])
    return finish(record, json_path)


def register(sub) -> None:
    p = sub.add_parser("hybrid", help="Qwen3.5-shaped hybrid target: verify vs decode step, rollback cost")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="JSON file")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--prompt", type=int, help="prompt tokens (default 512, tiny 32)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.set_defaults(func=lambda a: run(a.device, a.out, tiny=a.tiny, prompt=a.prompt, block=a.block, iters=a.iters))
