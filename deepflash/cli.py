"""deepflash command line: generate | info | serve | bench | train-drafter.

Errors a user can cause print one line and exit with code 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import UserError


def cmd_generate(args: argparse.Namespace) -> None:
    from .engine.runtime import engine_config, load_runtime
    from .engine.sampling import SamplingParams

    rt = load_runtime(engine_config(args))
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ())).validated()
    if args.raw:
        ids = rt.tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = rt.tokenizer.chat(messages + [{"role": "user", "content": args.prompt}])
    result = None
    for chunk in rt.engine.generate(ids, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    summary = result.to_json() | {"model": rt.model_name, "draft": rt.draft_name}
    if args.json:
        print(json.dumps(summary))
    else:
        print(_stats_line(summary), file=sys.stderr)


def _stats_line(s: dict) -> str:
    line = (f"[{s['prompt_tokens']} prompt + {s['generated_tokens']} generated tokens, "
            f"{s['tok_per_s']:.1f} tok/s, prefill {s['prefill_s'] * 1000:.0f} ms, finish: {s['finish_reason']}")
    if "acceptance_length" in s:
        line += (f"; acceptance length {s['acceptance_length']:.2f} over {s['spec_steps']} spec steps"
                 f" ({s['plain_steps']} plain)")
    return line + "]"


def cmd_info(args: argparse.Namespace) -> None:
    from .engine.memory import mib
    from .engine.runtime import engine_config, meta_models

    cfg = engine_config(args)
    target, drafter = meta_models(cfg)
    tcfg = target.cfg
    out = {
        "model": cfg.model or "embedded SmolLM2-135M-Instruct",
        "architecture": tcfg.model_type,
        "layers": tcfg.num_layers,
        "hidden_size": tcfg.hidden_size,
        "parameters": target.parameter_count(),
        "weight_bytes": target.weight_bytes(),
        "kv_bytes_per_token": target.kv_bytes_per_token(),
        "max_position_embeddings": tcfg.max_position_embeddings,
        "positions": tcfg.positions,
        "dtype": str(target.dtype).removeprefix("torch."),
    }
    if tcfg.positions > tcfg.max_position_embeddings:
        rope = tcfg.rope
        out["note"] = (f"positions past max_position_embeddings ({tcfg.max_position_embeddings}) come from YaRN: x"
                       f"{rope.factor:g} over the {rope.original_max_position}-token window the rope was made for; "
                       "how well the model reads that far is its own (check it on your task)")
    if drafter is not None:
        d = drafter.cfg
        out["drafter"] = {"layers": d.num_layers, "block_size": d.block_size, "target_layer_ids": list(d.target_layer_ids),
                          "trained_context_length": d.trained_context_length, "weight_bytes": drafter.weight_bytes(),
                          "feature_bytes_per_token_f32": target.feature_bytes_per_token(len(d.target_layer_ids))}
    plan = _plan(cfg, target, drafter) if args.plan else None
    if plan is not None:
        out["plan"] = plan.to_json()
    if args.json:
        print(json.dumps(out))
        return
    for key, value in out.items():
        if key == "plan":
            continue
        if key.endswith("bytes") or key.endswith("bytes_per_token"):
            value = f"{value:,} ({mib(value):.2f} MiB)" if value > 2**20 else f"{value:,}"
        print(f"{key:<24} {value}")
    if plan is not None:
        print(plan.table())


def _plan(cfg, target, drafter):
    """The memory plan of the engine `cfg` describes (models on the meta device: nothing is loaded)."""
    from .engine.memory import plan_memory
    from .engine.runtime import resolve_device, resolve_max_ctx

    device = resolve_device(cfg.device)
    return plan_memory(target, drafter, resolve_max_ctx(cfg, target, drafter, device), cfg, device)


def build_parser() -> argparse.ArgumentParser:
    from .engine.runtime import add_engine_args

    parser = argparse.ArgumentParser(prog="deepflash", description="DFlash speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (chat template unless --raw)")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("--system", help="system message")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    gen.add_argument("--seed", type=int, help="sampling seed (default: a random one, reported with --json)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="end stdout with one JSON line of results")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="architecture, size and memory plan of a model (pair)")
    info.add_argument("model_pos", nargs="?", metavar="MODEL")
    info.add_argument("--plan", action="store_true", help="print the memory plan")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(info)
    info.set_defaults(func=cmd_info)

    from .bench.cli import register as register_bench
    from .server import register as register_serve
    from .train.cli import register as register_training

    register_serve(sub)
    register_bench(sub)
    register_training(sub)
    _show_defaults(parser)
    return parser


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that states each option's default, where it has one worth stating."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".strip()


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's --help with _DefaultsFormatter."""
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _show_defaults(subparser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_pos", None):
        args.model = args.model or args.model_pos
    try:
        args.func(args)
    except UserError as err:
        print(f"deepflash: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
