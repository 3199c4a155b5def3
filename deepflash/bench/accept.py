"""deepflash bench accept: acceptance of a drafter on real prompts.

1. HumanEval (164 prompts as chat requests), T=0 and T=1: AL, histogram, per-position acceptance, tok/s
   against our plain decode.
2. Depth sweep: code-editing prompts of 1K..7.5K tokens whose answers copy text near the start, with
   the feature window at the full trained window, capped at 4096 and at 2048; the same windows on recall
   prompts (a module's opening, then that opening again: the target's continuation copies from far back).
3. Feature storage dtype sweep (f32, bf16, q8_0, q4_0) on the same prompts, full window.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from ..drafter.reach import copied_from_beyond, far_steps
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.runtime import load_runtime, resolve_device
from ..engine.sampling import SamplingParams
from ..engine.stats import SpecStats
from ..errors import UserError
from .common import environment, finish, save, table
from .prompts import depth_prompts, humaneval_messages, recall_prompts


def measure(engine: Engine, prompts: list[list[int]], params: SamplingParams, seeded: bool = False,
            warm_up: bool = True) -> tuple[dict, list[list[int]]]:
    """Run every prompt, after an untimed pass over them all when warm_up (as bench speed does: with a
    one-request warm-up, spec on measured 0.79x plain on HumanEval here where bench speed measured 1.1x
    on five of its prompts, H200; without it tok/s includes the first uses of
    graphs and kernels). Returns the speculative statistics summed over the timed pass (and each prompt's
    steps, committed tokens and trace), and its outputs."""
    total = SpecStats(engine.block_size) if engine.drafter is not None else None
    tokens, wall, decode, outputs, per_prompt, traces = 0, 0.0, 0.0, [], [], []
    for timed in (False, True) if warm_up else (True,):
        for i, ids in enumerate(prompts):
            p = SamplingParams(temperature=params.temperature, max_new_tokens=params.max_new_tokens,
                               seed=i if seeded else params.seed)
            began = time.perf_counter()
            r = engine.complete(ids, p)
            engine.wait_idle()
            if timed:
                wall += time.perf_counter() - began
                decode += r.decode_s
                tokens += r.generated_tokens
                outputs.append(r.token_ids)
                if total is not None:
                    _add(total, r.spec)
                    per_prompt.append([r.spec.steps, r.spec.committed])
                    traces.append(r.spec.trace)
    # tok_per_s counts each request's prefill, decode_tok_per_s its decode alone (bench speed's two rates)
    out = {"prompts": len(prompts), "tokens": tokens, "tok_per_s": tokens / wall, "decode_tok_per_s": tokens / decode}
    if total is not None:
        out.update(total.to_json())
        out["per_prompt_steps_committed"] = per_prompt
        out["per_prompt_trace"] = traces
    return out, outputs


def paired_change(base: dict, other: dict, resamples: int = 2000) -> dict:
    """AL of `other` relative to `base` on the same prompts (measure()'s rows), with a 95% bootstrap
    interval over prompts: greedy outputs are the target's in both, so the prompts pair up, and with a
    few prompts a difference of a few percent can be noise (the interval says how much)."""
    a = torch.tensor(base["per_prompt_steps_committed"], dtype=torch.float64)
    b = torch.tensor(other["per_prompt_steps_committed"], dtype=torch.float64)
    picks = torch.randint(0, len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(0))

    def al(rows, index=slice(None)):
        return rows[index, ..., 1].sum(-1) / rows[index, ..., 0].sum(-1)

    ratios = al(b, picks) / al(a, picks) - 1
    low, high = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"relative": round(float(al(b) / al(a) - 1), 4), "ci95": [round(low, 4), round(high, 4)]}


def _change(row: dict) -> str:
    vs = row.get("vs")
    if vs is None:
        return f"{row['acceptance_length']:.2f}"
    low, high = vs["ci95"]
    return f"{row['acceptance_length']:.2f} ({vs['relative']:+.1%} [{low:+.1%}, {high:+.1%}])"


def _with_reach(row: dict) -> str:
    reach = row.get("copied_from_beyond_window")
    if reach is None:
        return _change(row)
    far = row["far_steps"]
    steps = "" if far["capped"]["steps"] == 0 else \
        f"; from there {far['full']['acceptance_length']:.2f} -> {far['capped']['acceptance_length']:.2f}"
    return _change(row) + f", {reach:.1%} beyond{steps}"


def _add(total: SpecStats, s: SpecStats) -> None:
    total.steps += s.steps
    total.committed += s.committed
    total.draft_tokens += s.draft_tokens
    total.plain_steps += s.plain_steps
    total.spec_s += s.spec_s
    for name in ("histogram", "position_tries", "position_hits"):
        mine, theirs = getattr(total, name), getattr(s, name)
        for k, v in enumerate(theirs):
            mine[k] += v


def run(args) -> dict:
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before minutes of measuring, not after
        raise UserError("--plot needs matplotlib: pip install 'deepflash[bench]' (or leave --plot out)")
    device = resolve_device(args.device)
    rt = load_runtime(EngineConfig(model=args.model, draft=args.draft, device=args.device, dtype=args.dtype))
    tok, target, drafter = rt.tokenizer, rt.target, rt.drafter
    if drafter is None:
        raise UserError("bench accept needs a drafter (the embedded model ships one; else pass --draft)")
    record = {"bench": "accept", **environment(device), "draft": rt.draft_name,
              "target_dtype": str(target.dtype).removeprefix("torch."),
              "trained_context_length": drafter.cfg.trained_context_length, "max_new_tokens": args.max_new_tokens}

    humaneval = [tok.chat(m) for m in humaneval_messages(args.humaneval)]
    record["humaneval"] = {}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        spec, _ = measure(Engine(target, tok, drafter, config=EngineConfig(spec="on")), humaneval, params, seeded=True)
        plain, _ = measure(Engine(target, tok), humaneval, params, seeded=True)
        spec["speedup_vs_plain"] = spec["tok_per_s"] / plain["tok_per_s"]
        spec["plain_tok_per_s"] = plain["tok_per_s"]
        spec["decode_speedup_vs_plain"] = spec["decode_tok_per_s"] / plain["decode_tok_per_s"]
        spec["plain_decode_tok_per_s"] = plain["decode_tok_per_s"]
        record["humaneval"][f"T={temperature:g}"] = spec
    table("HumanEval (tok/s with prefill; decode tok/s without)",
          ["temperature", "AL", "tok/s", "plain tok/s", "speedup", "decode tok/s", "plain decode tok/s", "speedup"],
          [[k, v["acceptance_length"], v["tok_per_s"], v["plain_tok_per_s"], v["speedup_vs_plain"],
            v["decode_tok_per_s"], v["plain_decode_tok_per_s"], v["decode_speedup_vs_plain"]]
           for k, v in record["humaneval"].items()])
    save(record, args.out)

    depths = [int(d) for d in args.depths.split(",")]
    prompts = {d: depth_prompts(tok, d, args.per_depth) for d in depths}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    record["depth"] = window_sweep(target, tok, drafter, prompts, params)
    table("AL by depth and feature window (a cap: change against the full window [95% interval over prompts], "
          "share of the target's 6-grams copied from beyond the cap; AL full -> capped on the steps that begin "
          "in such text)", ["depth"] + list(WINDOWS),
          [[d] + [_with_reach(record["depth"][w][d]) for w in WINDOWS] for d in depths])
    save(record, args.out)

    if args.recall:
        depth, distance = _recall_shape(args.recall, args.max_new_tokens)
        recall = {depth: recall_prompts(tok, depth, distance, args.per_depth)}
        record["recall"] = {"distance": distance} | window_sweep(target, tok, drafter, recall, params)
        table(f"AL on recall prompts (raw text whose continuation the module holds {distance} tokens back), by "
              "feature window", ["depth"] + list(WINDOWS), [[depth] + [_with_reach(record["recall"][w][depth])
                                                                     for w in WINDOWS]])
        save(record, args.out)

    record["dtype"] = {}
    for fmt in ("f32", "bf16", "q8_0", "q4_0"):
        engine = Engine(target, tok, drafter, config=EngineConfig(spec="on", feature_dtype=fmt))
        record["dtype"][fmt] = {d: measure(engine, prompts[d], params, warm_up=False)[0] for d in depths}
        if fmt != "f32":
            for d in depths:
                record["dtype"][fmt][d]["vs"] = paired_change(record["dtype"]["f32"][d], record["dtype"][fmt][d])
    table("AL by feature dtype (change against f32 [95% interval over prompts])", ["depth", "f32", "bf16", "q8_0",
          "q4_0"], [[d] + [_change(record["dtype"][f][d]) for f in record["dtype"]] for d in depths])
    if args.plot:
        plot(record, args.plot)
    return finish(record, args.out)


WINDOWS = {"full": None, "4096": 4096, "2048": 2048}


def window_sweep(target, tok, drafter, prompts: dict[int, list[list[int]]], params: SamplingParams) -> dict:
    """Each prompt set's acceptance with the feature window at the full trained window and capped
    (WINDOWS); a cap's rows carry their change against the full window, the share of the target's
    6-grams copied from beyond the cap, and AL on the steps that begin in such text (far_step_change).
    One pass each: this compares acceptance, not speed (tok/s includes first uses)."""
    record = {name: {} for name in WINDOWS}
    for name, cap in WINDOWS.items():
        engine = Engine(target, tok, drafter, config=EngineConfig(spec="on", feat_ring_cap=cap))
        for key, ids in prompts.items():
            stats, outputs = measure(engine, ids, params, warm_up=False)
            record[name][key] = stats | {"window": engine.window}
            if cap is not None:  # greedy: every window's outputs are the target's own
                record[name][key]["copied_from_beyond_window"] = copied_from_beyond(ids, outputs, cap)
                record[name][key]["vs"] = paired_change(record["full"][key], stats)
                record[name][key]["far_steps"] = far_step_change(ids, outputs, record["full"][key], stats, cap)
    return record


def far_step_change(prompts: list[list[int]], outputs: list[list[int]], full: dict, capped: dict,
                    window: int) -> dict:
    """AL on the steps that began where the target's next tokens lie only beyond `window` (reach.far_steps),
    with the full window and capped (measure()'s rows on the same greedy outputs), and the cap's change over
    the prompts with such steps in both runs: the steps a cap can cost, where the whole AL dilutes them
    with the steps it cannot."""
    runs = {"full": full, "capped": capped}
    commits = {name: [far_steps(ids, out, trace, window) for ids, out, trace in
                      zip(prompts, outputs, run["per_prompt_trace"])] for name, run in runs.items()}
    record = {}
    for name, per_prompt in commits.items():
        flat = [c for row in per_prompt for c in row]
        record[name] = {"steps": len(flat), "acceptance_length": round(sum(flat) / len(flat), 4) if flat else None}
    both = [i for i in range(len(prompts)) if commits["full"][i] and commits["capped"][i]]
    if both:
        rows = {name: {"per_prompt_steps_committed": [[len(commits[name][i]), sum(commits[name][i])] for i in both]}
                for name in runs}
        record["vs"] = paired_change(rows["full"], rows["capped"])
    return record


def _recall_shape(spec: str, new_tokens: int) -> tuple[int, int]:
    """--recall DEPTH:DISTANCE -> (depth, distance); the repeated opening must end at least `new_tokens`
    before the first copy does, so that the whole continuation has a source to copy."""
    try:
        depth, distance = (int(v) for v in spec.split(":"))
    except ValueError:
        raise UserError(f"--recall wants DEPTH:DISTANCE in tokens (e.g. 7500:4500), got {spec!r}") from None
    if not (0 < depth - distance and depth - distance + new_tokens <= distance):
        raise UserError(f"--recall {spec}: the repeated opening (DEPTH - DISTANCE tokens) must end at least "
                        f"--max-new-tokens ({new_tokens}) before the first copy (DISTANCE tokens) does")
    return depth, distance


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for name, rows in record["depth"].items():
        depths = sorted(rows)
        ax.plot(depths, [rows[d]["acceptance_length"] for d in depths], marker="o", label=f"window {name}")
    ax.set(title="AL vs prompt depth", xlabel="prompt tokens", ylabel="acceptance length")
    ax.legend()
    ax = axes[1]
    fmts = list(record["dtype"])
    depths = sorted(next(iter(record["dtype"].values())))
    width = 0.8 / len(fmts)
    for i, fmt in enumerate(fmts):
        ax.bar([j + i * width for j in range(len(depths))],
               [record["dtype"][fmt][d]["acceptance_length"] for d in depths], width, label=fmt)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(depths))], [str(d) for d in depths])
    ax.set(title="AL by feature storage dtype", xlabel="prompt tokens", ylabel="acceptance length")
    ax.legend()
    ax = axes[2]
    for name, r in record["humaneval"].items():
        hist = r["acceptance_histogram"]
        total = sum(hist) or 1
        ax.plot(range(1, len(hist) + 1), [h / total for h in hist], marker=".", label=f"HumanEval {name}")
    ax.set(title="tokens committed per verify step", xlabel="committed tokens", ylabel="share of steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def register(sub) -> None:
    p = sub.add_parser("accept", help="acceptance on HumanEval, by depth and window, by feature dtype")
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto",
                   help="the pair's dtype: auto (bf16 on CUDA, f32 on CPU), float32, bfloat16, float16")
    p.add_argument("--humaneval", type=int, help="limit the number of HumanEval prompts (default: all 164)")
    p.add_argument("--depths", default="1024,2048,4096,6144,7500")
    p.add_argument("--per-depth", type=int, default=4)
    p.add_argument("--recall", default="7500:4500", metavar="DEPTH:DISTANCE",
                   help="also sweep the windows on raw recall prompts of DEPTH tokens that repeat a module's "
                        "opening DISTANCE tokens after it ('' to skip)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", help="JSON file")
    p.add_argument("--plot", help="PNG file")
    p.set_defaults(func=run)
