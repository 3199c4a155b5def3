"""Where the measured peak of `deepflash bench memory` comes from (issue 4: the plan must be within 10%
of the peak). Records the CUDA allocator's history over one long request, replays it to find the
peak, and groups the blocks alive at that moment by the first deepflash source line that allocated
them. Prints the top groups and writes JSON (GPU only).

    python3 scripts/gpu/mem_peak.py --out mem_peak.json [--feature-dtype f32] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from deepflash.bench.prompts import depth_prompts
from deepflash.engine.config import EngineConfig
from deepflash.engine.runtime import load_runtime
from deepflash.engine.sampling import SamplingParams


def trace_events() -> list[dict]:
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def origin(frames: list[dict]) -> str:
    """The innermost frame in our code (deepflash/ or scripts/), else the innermost frame."""
    for f in frames:
        if "/deepflash/" in f["filename"] or "/scripts/" in f["filename"]:
            return f"{f['filename'].split('/deepflash/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(events: list[dict], begin: int) -> tuple[int, int, dict[int, tuple[int, dict]]]:
    """Replay alloc/free events; the peak of live bytes from event `begin` on, its index and live set
    (address -> (event index, event))."""
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at = begin
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if i >= begin and total > peak:
            peak, peak_at = total, i
    live.clear()
    for i, e in enumerate(events[: peak_at + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (i, e)
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, peak_at, live


def grouped(blocks) -> list[dict]:
    groups: dict[str, list[int]] = defaultdict(list)
    for e in blocks:
        groups[origin(e.get("frames", []))].append(e["size"])
    rows = [{"origin": k, "bytes": sum(v), "blocks": len(v)} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--feature-dtype", default="f32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    rt = load_runtime(EngineConfig(device="cuda", max_ctx=8192, feature_dtype=args.feature_dtype, spec="on"))
    prompt = depth_prompts(rt.tokenizer, 8192 - args.max_new_tokens - 64, 1)[0]
    torch.cuda.synchronize()
    loaded = len(trace_events())
    torch.cuda.reset_peak_memory_stats()
    rt.engine.complete(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    events = trace_events()
    peak, peak_at, live = live_at_peak(events, loaded)
    before = [e for i, e in live.values() if i < loaded]
    during = [e for i, e in live.values() if i >= loaded]
    record = {"feature_dtype": args.feature_dtype, "prompt_tokens": len(prompt), "plan": rt.plan.parts,
              "plan_bytes": rt.plan.total, "max_memory_allocated": measured, "replayed_peak": peak,
              "peak_event": peak_at, "events": len(events), "peak_frames": events[peak_at].get("frames", [])[:12],
              "alive_from_loading": grouped(before)[:30], "allocated_during_request": grouped(during)[:30]}
    for title, rows in (("alive from loading", record["alive_from_loading"]),
                        ("allocated during the request, alive at the peak", record["allocated_during_request"])):
        print(f"--- {title}: {sum(r['bytes'] for r in rows) / 2**20:.1f} MiB (top groups)")
        for r in rows[:15]:
            print(f"{r['bytes'] / 2**20:10.1f} MiB {r['blocks']:6d}  {r['origin']}")
    print(f"plan {rt.plan.total / 2**20:.1f} MiB, max_memory_allocated {measured / 2**20:.1f} MiB, "
          f"replayed peak {peak / 2**20:.1f} MiB")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
