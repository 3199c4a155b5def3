"""Where a plain decode step's time goes: kernels per step and the top kernels by device time (eager,
under torch.profiler), then decode tok/s with CUDA graphs, for random-weight bf16 targets shaped like
SmolLM2-135M and Qwen3-8B. Ends with one JSON line."""

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import torch

from deepflash.bench.speed import QWEN3_8B, SMOLLM2_135M, random_engine, run_engine
from deepflash.drafter.checkpoint import load_drafter
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.graphs import kv_bucket
from deepflash.engine.runtime import DEFAULT_DRAFTER
from deepflash.engine.sampling import SamplingParams
from deepflash.kernels import rope as rope_kernel

LONG_PROMPT = [100 + i % 40000 for i in range(5800)]


def kernel_profile(engine: Engine, prompt: list[int], steps: int) -> dict:
    params = SamplingParams(max_new_tokens=steps)
    engine.complete(prompt, params)
    engine.wait_idle()  # the steps it left queued past its end run before the profile
    cuda = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU  # CPU: a dry run only
    with torch.profiler.profile(activities=[activity]) as prof:
        engine.complete(prompt, params)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == kind:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time if cuda else e.cpu_time
    count = sum(v[0] for v in by_name.values())
    busy = sum(v[1] for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])  # every kernel: the small ones add up
    # per step including the prompt's one prefill forward spread over the steps (~10 kernels each)
    return {"kernels_per_step": count / steps, "device_us_per_step": busy / steps,
            "top": [{"kernel": k[:160], "per_step": n / steps, "us_per_step": t / steps} for k, (n, t) in top]}


def timeline(engine: Engine, prompt: list[int], steps: int) -> dict:
    """Device time of graph-replayed steps as the GPU saw it: the span from the first kernel to the last,
    the time some kernel ran (the union over streams) and the idle rest, and the largest idle gaps by
    the kernels on either side (names cut to 60 characters), per step; then one step in the middle
    kernel by kernel (each decode step ends with the kernel that posts its result to the mailbox: `_post`,
    or a speculative step's acceptance, `_accept`, where it posts itself): its start and length, and the
    stream it ran on. An eager profile (kernel_profile) sums kernel times; it cannot show what the
    launches between kernels and graphs cost, nor which kernels wait for which."""
    params = SamplingParams(max_new_tokens=steps)
    for _ in range(2):  # captures, then a warm run
        engine.complete(prompt, params)
    engine.wait_idle()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.complete(prompt, params)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60], e.thread) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps, reach, before = 0.0, defaultdict(lambda: [0, 0.0]), spans[0][0], spans[0][2]
    for start, end, name, _ in spans:
        if start > reach:
            gaps[(before, name)][0] += 1
            gaps[(before, name)][1] += start - reach
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    span = reach - spans[0][0]
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:25]
    posts = ([i for i, (_, _, name, _) in enumerate(spans) if name == "_post"]
             or [i for i, (_, _, name, _) in enumerate(spans) if name == "_accept"])
    middle = len(posts) // 2
    one = spans[posts[middle - 1] + 1 : posts[middle] + 1] if len(posts) >= 2 else []
    return {"steps": steps, "span_us_per_step": span / steps, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (span - busy) / steps,
            "gaps": [{"after": a, "before": b, "per_step": n / steps, "us_per_step": t / steps}
                     for (a, b), (n, t) in top],
            "one_step": [{"kernel": name, "start_us": start - one[0][0], "us": end - start, "stream": stream}
                         for start, end, name, stream in one]}


def graph_steps(engine: Engine, prompt: list[int], counts: list[int], replays: int = 48) -> dict:
    """Where a step's time goes between the device and the host. The engine loop's decode us per token (128
    tokens, after an identical untimed request) and its host time by function (cProfile, one more request);
    then the device us per step when K consecutive steps share one CUDA graph (K in `counts`), replayed back
    to back with nothing on the host between, and the host's us per replay call: against K = 1, what the
    boundary between two step graphs costs the GPU. The engine's own steps (plain, or spec-on when it has a
    drafter), all at one KV bucket."""
    params = SamplingParams(max_new_tokens=128)
    engine.complete(prompt, params)
    result = engine.complete(prompt, params)
    timings = {"engine_loop_us_per_token": 1e6 * result.decode_s / (len(result.token_ids) - 1)}
    profiler = cProfile.Profile()
    profiler.runcall(engine.complete, prompt, params)
    engine.wait_idle()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    timings["host_profile"] = out.getvalue()
    size = engine.block_size if engine.drafter is not None else 1
    kv_len = kv_bucket(len(prompt) + 3 * 128 + size * max(counts) * (replays + 1), engine.max_ctx)

    def step():
        if engine.drafter is not None:
            engine.steps.speculate(size, kv_len, params)
        else:
            engine.steps.plain(kv_len, params)

    for count in counts:
        engine.graphs.run(("probe", count), lambda: [step() for _ in range(count)])  # captures, runs once
        graph = engine.graphs.graphs[("probe", count)]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        host = time.perf_counter()
        for _ in range(replays // count):
            graph.replay()
        host = time.perf_counter() - host
        end.record()
        end.synchronize()
        timings[count] = {"device_us_per_step": 1000 * begin.elapsed_time(end) / (replays // count * count),
                          "host_us_per_replay": 1e6 * host / (replays // count)}
    return timings


def spec_on_and_plain(device: str, measure) -> dict:
    """measure(engine) of a random SmolLM2-shaped target on Triton's kernels, with the shipped drafter (spec on)
    and without."""
    plain = random_engine(SMOLLM2_135M, device, EngineConfig(max_ctx=2048, target_kernels="triton"))
    drafter = load_drafter(DEFAULT_DRAFTER, plain.device, plain.target.dtype)
    return {"spec_on": measure(sibling(plain, drafter, spec="on", target_kernels="triton")), "plain": measure(plain)}


def sibling(base: Engine, drafter=None, **engine_args) -> Engine:
    """Another engine on base's random target, also without stop tokens (every request runs its length)."""
    made = Engine(base.target, base.tokenizer, drafter, EngineConfig(**{"max_ctx": base.max_ctx, **engine_args}))
    made.stop_ids = base.stop_ids
    return made


def capture_profile(plain: Engine, prompt: list[int]) -> dict:
    """Plain steps that capture the shipped drafter's tap features for it (spec off), on the Triton
    kernels: against the plain figures, what feature capture costs per step."""
    drafter = load_drafter(DEFAULT_DRAFTER, plain.device, plain.target.dtype)
    capturing = dict(spec="off", target_kernels="triton")
    prof = kernel_profile(sibling(plain, drafter, cuda_graphs=False, **capturing), prompt, 64)
    prof["graphs_tok_per_s"] = decode_rate(sibling(plain, drafter, **capturing), prompt, 256)
    return prof


def spec_profile(plain: Engine, prompt: list[int]) -> dict:
    """Speculative steps with the shipped drafter (spec on, Triton target kernels). On the random target
    no draft matches, so every step commits one token: per-token figures are per-step figures. Kernels
    per step (eager), then under CUDA graphs the steps/s and a speculative step's device time (the
    engine's CUDA-event phase timer)."""
    drafter = load_drafter(DEFAULT_DRAFTER, plain.device, plain.target.dtype)
    speculating = dict(spec="on", target_kernels="triton" if rope_kernel.available() else "torch")
    prof = kernel_profile(sibling(plain, drafter, cuda_graphs=False, **speculating), prompt, 64)
    graphs = sibling(plain, drafter, **speculating)
    prof["graphs_steps_per_s"] = decode_rate(graphs, prompt, 256)
    stats = graphs.complete(prompt, SamplingParams(max_new_tokens=256)).spec
    prof["spec_us_per_step"] = 1e6 * stats.spec_s / stats.steps
    return prof


def depth_profile(plain: Engine, prompt: list[int] = LONG_PROMPT, steps: int = 48) -> dict:
    """Kernels per step after the prompt (SmolLM2 shape, Triton kernels, eager), spec on with the
    shipped drafter and plain: where a step's time goes at that depth (the prompt's prefill is spread
    over the steps)."""
    drafter = load_drafter(DEFAULT_DRAFTER, plain.device, plain.target.dtype)
    engines = {"spec_on": sibling(plain, drafter, spec="on", target_kernels="triton", cuda_graphs=False, max_ctx=8192),
               "plain": sibling(plain, target_kernels="triton", cuda_graphs=False, max_ctx=8192)}
    return {name: kernel_profile(engine, prompt, steps) for name, engine in engines.items()}


def prefill_profile(plain: Engine, lengths: list[int]) -> dict:
    """Prefill alone (one new token) without and with the shipped drafter (spec on, Triton kernels): its
    time per prompt length, and for the drafter's the host calls and device kernels that take the most
    time under torch.profiler."""
    drafter = load_drafter(DEFAULT_DRAFTER, plain.device, plain.target.dtype)
    kernels = "triton" if rope_kernel.available() else "torch"
    engines = {"plain": sibling(plain, target_kernels=kernels, max_ctx=8192),
               "drafter": sibling(plain, drafter, spec="on", target_kernels=kernels, max_ctx=8192)}
    params = SamplingParams(max_new_tokens=1)
    out: dict = {}
    for length in lengths:
        prompt = [100 + i % 40000 for i in range(length)]
        for name, engine in engines.items():
            engine.complete(prompt, params)
            out[f"{name}_ms_{length}"] = 1e3 * min(engine.complete(prompt, params).prefill_s for _ in range(3))
        with torch.profiler.profile() as prof:
            engines["drafter"].complete(prompt, params)
        events = prof.key_averages()
        for side, field, limit in (("host", "self_cpu_time_total", 15), ("device", "self_device_time_total", 10)):
            ranked = sorted(events, key=lambda e: -getattr(e, field))[:limit]
            out[f"drafter_top_{side}_{length}"] = [{"op": e.key[:90], "calls": e.count, "ms": getattr(e, field) / 1e3}
                                                   for e in ranked]
        print(f"  prefill {length} tokens: plain {out[f'plain_ms_{length}']:.1f} ms, with the drafter "
              f"{out[f'drafter_ms_{length}']:.1f} ms; the drafter's top host calls:")
        for row in out[f"drafter_top_host_{length}"]:
            print(f"  {row['ms']:8.2f} ms  x{row['calls']:5d}  {row['op']}")
    return out


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> float:
    """tok/s of one request, prefill included, after an untimed identical one."""
    return run_engine(engine, [prompt], tokens, SamplingParams(max_new_tokens=tokens))["tok_per_s"]


def print_top(label: str, rows: list[dict]) -> None:
    print(f"  {label}:")
    for row in rows:
        print(f"  {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['kernel']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec-only", action="store_true",
                    help="only the speculative step with the shipped drafter (SmolLM2 shape, Triton kernels); "
                         "with --prefill, both")
    ap.add_argument("--prefill", action="store_true",
                    help="only the prefill, without and with the shipped drafter (SmolLM2 shape, 170 and 5849 tokens)")
    ap.add_argument("--depth", action="store_true",
                    help="only the kernels of spec-on and plain steps after a 5.8K-token prompt (SmolLM2 shape)")
    ap.add_argument("--short", action="store_true",
                    help="only the kernels of spec-on and plain steps after a 256-token prompt (SmolLM2 shape)")
    ap.add_argument("--qwen3", action="store_true",
                    help="only the kernels of a plain step after a 256-token prompt (Qwen3-8B shape, Triton kernels)")
    ap.add_argument("--timeline", action="store_true",
                    help="only the idle time between kernels of CUDA-graph steps, spec on and plain, after a "
                         "256-token prompt (SmolLM2 shape, Triton kernels)")
    ap.add_argument("--graph-steps", metavar="K,...",
                    help="only the device us per step with K steps in one CUDA graph replayed back to back, spec on "
                         "and plain (SmolLM2 shape, Triton kernels, 256-token prompt), e.g. 1,2,4")
    args = ap.parse_args()
    prompt = list(range(100, 356))
    record = {}
    if args.qwen3:
        prof = kernel_profile(random_engine(QWEN3_8B, args.device, EngineConfig(max_ctx=2048, cuda_graphs=False, target_kernels="triton")),
                              prompt, 64)
        record["qwen3-8b-shaped"] = {"short": {"plain": prof}}
        print_top(f"qwen3-8b-shaped plain after {len(prompt)} tokens: {prof['device_us_per_step']:.0f} us busy/step",
                  prof["top"][:16])
    if args.spec_only:  # with --prefill both run
        record.setdefault("smollm2-shaped", {})["spec_on"] = spec_profile(random_engine(SMOLLM2_135M, args.device),
                                                                           prompt)
        print_top("spec on, Triton kernels", record["smollm2-shaped"]["spec_on"]["top"])
    if args.prefill:
        record.setdefault("smollm2-shaped", {})["prefill"] = prefill_profile(random_engine(SMOLLM2_135M, args.device),
                                                                             [170, 5849])
    if args.timeline:
        record.setdefault("smollm2-shaped", {})["timeline"] = spec_on_and_plain(
            args.device, lambda engine: timeline(engine, prompt, 128))
        for name, line in record["smollm2-shaped"]["timeline"].items():
            print(f"  {name}: span {line['span_us_per_step']:.1f} us/step, busy {line['busy_us_per_step']:.1f}, "
                  f"idle {line['idle_us_per_step']:.1f}; largest gaps:")
            for gap in line["gaps"][:12]:
                print(f"  {gap['us_per_step']:7.2f} us x{gap['per_step']:5.2f}  {gap['after']} -> {gap['before']}")
            print("  one step, kernel by kernel (start us, length us, stream):")
            for row in line["one_step"]:
                print(f"  {row['start_us']:8.1f} {row['us']:6.2f} {row['stream']:>4}  {row['kernel']}")
    if args.graph_steps:
        counts = [int(k) for k in args.graph_steps.split(",")]
        record.setdefault("smollm2-shaped", {})["graph_steps"] = spec_on_and_plain(
            args.device, lambda engine: graph_steps(engine, prompt, counts))
        for name, timings in record["smollm2-shaped"]["graph_steps"].items():
            print(timings["host_profile"])
            per_graph = ", ".join(f"{k} steps a graph {timings[k]['device_us_per_step']:.1f} us/step on the device, "
                                  f"{timings[k]['host_us_per_replay']:.1f} us/replay on the host" for k in counts)
            print(f"  {name}: engine loop {timings['engine_loop_us_per_token']:.1f} us/token; {per_graph}")
    for key, wanted, at, steps in (("depth", args.depth, LONG_PROMPT, 48), ("short", args.short, prompt, 64)):
        if wanted:
            record.setdefault("smollm2-shaped", {})[key] = depth_profile(random_engine(SMOLLM2_135M, args.device), at,
                                                                         steps)
            for name, prof in record["smollm2-shaped"][key].items():
                print_top(f"{name} after {len(at)} tokens: {prof['device_us_per_step']:.0f} us busy/step",
                          prof["top"][:12])
    alone = (args.spec_only or args.prefill or args.depth or args.short or args.qwen3
             or args.timeline or args.graph_steps)
    shapes = [] if alone else [("smollm2-shaped", SMOLLM2_135M), ("qwen3-8b-shaped", QWEN3_8B)]
    for name, shape in shapes:
        eager = random_engine(shape, args.device, EngineConfig(max_ctx=2048, cuda_graphs=False, target_kernels="torch"))
        prof = kernel_profile(eager, prompt, 64)
        graphs = sibling(eager, target_kernels="torch")
        prof["graphs_tok_per_s"] = decode_rate(graphs, prompt, 256)
        # SDPA picks cuDNN attention for the one-query step (10-14 us per layer): the same with it off
        torch.backends.cuda.enable_cudnn_sdp(False)
        other = sibling(eager, target_kernels="torch")
        prof["graphs_tok_per_s_without_cudnn_sdpa"] = decode_rate(other, prompt, 256)
        torch.backends.cuda.enable_cudnn_sdp(True)
        # the target's Triton kernels (TargetModel.use_kernels: rope + cache write, decode attention,
        # add + norm, SwiGLU) in place of the torch forms
        prof["graphs_tok_per_s_triton_kernels"] = None  # without Triton (a CPU dry run): not measured
        if rope_kernel.available():
            fused = sibling(eager, target_kernels="triton")
            prof["graphs_tok_per_s_triton_kernels"] = decode_rate(fused, prompt, 256)
            # where the step's time goes on the Triton kernels (the CUDA default), profiled eagerly
            fused_eager = sibling(eager, target_kernels="triton", cuda_graphs=False)
            prof["triton_kernels"] = kernel_profile(fused_eager, prompt, 64)
            del fused, fused_eager
            if name == "smollm2-shaped":  # the shipped drafter's taps fit this shape
                prof["triton_kernels_capturing"] = capture_profile(eager, prompt)
                prof["spec_on"] = spec_profile(eager, prompt)
        prof["eager_tok_per_s"] = decode_rate(eager, prompt, 64)
        record[name] = prof
        print(f"== {name}: {prof['kernels_per_step']:.0f} kernels/step, {prof['device_us_per_step']:.0f} us busy/step, "
              f"graphs {prof['graphs_tok_per_s']:.0f} tok/s ({prof['graphs_tok_per_s_without_cudnn_sdpa']:.0f} without "
              f"cuDNN attention, {prof['graphs_tok_per_s_triton_kernels']} with the Triton kernels), "
              f"eager {prof['eager_tok_per_s']:.0f} tok/s")
        capturing = prof.get("triton_kernels_capturing")
        if capturing:
            print(f"  capturing features (spec off): {capturing['kernels_per_step']:.0f} kernels/step, "
                  f"{capturing['device_us_per_step']:.0f} us busy/step, graphs {capturing['graphs_tok_per_s']:.0f} tok/s")
        for label, rows in [("torch kernels", prof["top"]), ("Triton kernels", prof.get("triton_kernels", {}).get("top", [])),
                            ("spec on, Triton kernels", prof.get("spec_on", {}).get("top", []))]:
            print_top(label, rows)
        del eager, graphs, other
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.out:
        open(args.out, "w").write(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
