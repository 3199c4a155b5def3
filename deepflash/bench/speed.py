"""deepflash bench speed: our plain decode and DFlash against transformers on the same prompts, plus
plain decode of a Qwen3-8B-shaped random model as a fraction of the device's copy bandwidth (MBU)."""

from __future__ import annotations

import time

import torch

from ..drafter.model import DFlashDrafter
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.runtime import load_runtime, resolve_device
from ..engine.sampling import SamplingParams
from ..errors import UserError
from ..loading.tokenizer import word_tokenizer
from ..models import init_random_, materialize, random_model
from ..models.config import ModelConfig
from .common import copy_bandwidth, environment, finish, forward_seconds, sync, table
from .prompts import depth_prompts, humaneval_messages

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                   max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
TORCH_KERNELS = " + torch target kernels"  # the suffix of the systems run with --target-kernels torch


def run_engine(engine: Engine, prompts: list[list[int]], max_new: int, params: SamplingParams) -> dict:
    """One untimed pass over the prompts (every CUDA graph variant gets captured), then time each prompt
    end to end."""
    for ids in prompts:
        engine.complete(ids, params)
    tokens = steps = committed = plain_steps = 0
    wall = decode = prefill = 0.0
    outputs, per_prompt = [], []
    for ids in prompts:
        began = time.perf_counter()
        r = engine.complete(ids, params)
        engine.wait_idle()
        elapsed = time.perf_counter() - began
        wall += elapsed
        decode += r.decode_s
        prefill += r.prefill_s
        tokens += r.generated_tokens
        outputs.append(r.token_ids)
        # per prompt, so that short and long contexts can be told apart; the prefill and the rest of the
        # wall time (host work outside both) show where end-to-end time goes beyond the decode
        per_prompt.append({"prompt_tokens": len(ids), "tokens": r.generated_tokens,
                           "decode_tok_per_s": r.generated_tokens / r.decode_s if r.decode_s else None,
                           "prefill_s": r.prefill_s, "wall_s": elapsed})
        if r.spec is not None:
            # the steps in order (tokens per spec step, 0 per plain one): where --spec auto ran its bursts
            per_prompt[-1].update(acceptance_length=r.spec.acceptance_length, trace=r.spec.trace)
            steps += r.spec.steps
            committed += r.spec.committed
            plain_steps += r.spec.plain_steps
    out = {"tokens": tokens, "tok_per_s": tokens / wall, "decode_tok_per_s": tokens / decode, "prefill_s": prefill,
           "outside_decode_and_prefill_s": wall - decode - prefill, "outputs": outputs, "per_prompt": per_prompt}
    if engine.drafter is not None:  # how the controller split the steps (a never-matching drafter's probes)
        out.update(spec_steps=steps, plain_steps=plain_steps)
    if steps:
        out["acceptance_length"] = committed / steps
    return out


def run_transformers(model, prompts: list[list[int]], max_new: int, **generate_args) -> dict:
    """As run_engine: one untimed pass over the same prompts first (the static cache compiles per
    prompt length), then time each prompt end to end."""
    device = model.device

    def generate(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=device)
        return model.generate(x, max_new_tokens=max_new, do_sample=False, **generate_args)[0, len(ids):].tolist()

    for ids in prompts:
        generate(ids)
    outputs, wall = [], 0.0
    for ids in prompts:
        sync(device)
        began = time.perf_counter()
        outputs.append(generate(ids))
        sync(device)
        wall += time.perf_counter() - began
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "tok_per_s": tokens / wall, "outputs": outputs}


def never_matching_drafter(like: DFlashDrafter) -> DFlashDrafter:
    """Same shape as the real drafter, random weights: its drafts (almost) never match."""
    with torch.device("meta"):
        drafter = DFlashDrafter(like.cfg).to(like.dtype)
    drafter = drafter.to_empty(device=like.device)
    init_random_(drafter, seed=123, std=0.02)
    return materialize(drafter, like.device).eval().requires_grad_(False).fuse_projections()


def random_target(shape: dict, device: torch.device | str):
    """A random-weight bf16 target of an HF config shape (the same weights every call)."""
    return random_model(ModelConfig.from_hf(shape), device=device, dtype=torch.bfloat16, seed=0, std=0.02,
                        on_device=True)


def random_engine(shape: dict, device: torch.device | str, config: EngineConfig = EngineConfig(max_ctx=2048)
                  ) -> Engine:
    """An engine over random_target(shape), without stop tokens (random weights: every request
    generates exactly max_new tokens)."""
    target = random_target(shape, device)
    engine = Engine(target, word_tokenizer(target.cfg.vocab_size), config=config)
    engine.stop_ids = frozenset()
    return engine


def qwen3_8b_mbu(device: torch.device, bandwidth: float, prompt_len: int = 256, max_new: int = 128,
                 kernels: str = "auto") -> dict:
    """Plain decode of a random-weight Qwen3-8B-shaped bf16 model; MBU = bytes read per step x tok/s /
    copy bandwidth (bytes read: weights a decode step touches plus the KV span attended)."""
    engine = random_engine(QWEN3_8B, device, EngineConfig(max_ctx=2048, target_kernels=kernels))
    target = engine.target
    prompt = torch.randint(2, target.cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    stats = run_engine(engine, [prompt] * 3, max_new, SamplingParams(max_new_tokens=max_new))
    kv_span = 512  # the attention bucket these positions fall in (graphs.kv_bucket)
    step_bytes = target.decode_weight_bytes() + kv_span * target.kv_bytes_per_token()
    mbu = step_bytes * stats["decode_tok_per_s"] / (bandwidth * 1e9)
    del engine, target
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"decode_tok_per_s": stats["decode_tok_per_s"], "bytes_per_step": step_bytes, "mbu": mbu}


# the seed's targets at their real widths, depth cut to fit one 80 GB GPU beside the engine's buffers:
# (family of bench families, layers)
WIDE_SHAPES = {"qwen3.5-27b": ("qwen3.5", 16), "qwen3.6-35b-a3b": ("qwen3.5-moe", 12),
               "qwen3-30b-a3b": ("qwen3-moe", 16)}
MBU_CONTEXT = 512  # tokens of context when a wide shape's steps are timed
BLOCK = 16  # the verify block of the wide shapes (the random drafter's)


def wide_shape_mbu(name: str, device: torch.device, bandwidth: float) -> dict:
    """A wide shape's random bf16 target on the kernels `auto` picks: its decode and 16-token verify forwards
    alone (CUDA graphs at MBU_CONTEXT), MBU on the bytes a decode step reads (routed experts only for MoE),
    and a DFlash step's draft and verify with a random drafter (the engine's own steps)."""
    from .depth import step_row
    from .families import family_shape, random_drafter_for

    family, layers = WIDE_SHAPES[name]
    target = random_target(family_shape(family, "wide", layers), device).use_kernels("auto")
    decode_s, verify_s = forward_seconds(target, 1, MBU_CONTEXT), forward_seconds(target, BLOCK, MBU_CONTEXT)
    step_bytes = target.decode_weight_bytes() + MBU_CONTEXT * target.kv_bytes_per_token()
    engine = Engine(target, word_tokenizer(target.cfg.vocab_size), random_drafter_for(target),
                    config=EngineConfig(spec="on", max_ctx=2 * MBU_CONTEXT))
    dflash = step_row(engine, MBU_CONTEXT, BLOCK)
    del engine, target
    torch.cuda.empty_cache()
    return {"layers": layers, "decode_ms": decode_s * 1e3, "decode_tok_per_s": 1 / decode_s, "bytes_per_step": step_bytes,
            "mbu": step_bytes / decode_s / (bandwidth * 1e9), "verify_ms": verify_s * 1e3,
            "verify_over_decode": verify_s / decode_s, "dflash_draft_ms": dflash["draft_ms"],
            "dflash_verify_ms": dflash["verify_ms"],
            "dflash_step_over_decode": (dflash["draft_ms"] + dflash["verify_ms"]) / (decode_s * 1e3)}


def mbu_part(args, device: torch.device, bandwidth: float) -> dict:
    if args.shape != "qwen3-8b":
        if device.type != "cuda":
            raise UserError("the wide shapes' MBU times CUDA graphs: it needs a CUDA device")
        result = wide_shape_mbu(args.shape, device, bandwidth)
        table(f"{args.shape}-shaped random bf16 target ({result['layers']} layers), {MBU_CONTEXT} tokens of context",
              ["decode ms", "tok/s", "MBU", "verify/decode", "DFlash step/decode"],
              [[result["decode_ms"], result["decode_tok_per_s"], result["mbu"], result["verify_over_decode"],
                result["dflash_step_over_decode"]]])
        return finish({"bench": "speed", "part": "mbu", "shape": args.shape, **environment(device),
                       "copy_bandwidth_gb_s": bandwidth, "context": MBU_CONTEXT, "results": {args.shape: result}},
                      args.out)
    results = {"qwen3-8b-shaped plain decode": qwen3_8b_mbu(device, bandwidth)}
    if device.type == "cuda":  # the default there is Triton's kernels
        results["qwen3-8b-shaped plain decode" + TORCH_KERNELS] = qwen3_8b_mbu(device, bandwidth, kernels="torch")
    table("Qwen3-8B-shaped random bf16 target, plain decode", ["system", "tok/s", "bytes/step", "MBU"],
          [[name, r["decode_tok_per_s"], r["bytes_per_step"], r["mbu"]] for name, r in results.items()])
    return finish({"bench": "speed", "part": "mbu", **environment(device), "copy_bandwidth_gb_s": bandwidth,
                   "results": results}, args.out)


def run(args) -> dict:
    device = resolve_device(args.device)
    bandwidth = copy_bandwidth(device)
    if args.part == "mbu":
        return mbu_part(args, device, bandwidth)
    if args.shape != "qwen3-8b":
        raise UserError("--shape chooses the model of --part mbu")
    rt = load_runtime(EngineConfig(model=args.model, draft=args.draft, device=args.device))
    if rt.drafter is None:
        raise UserError("bench speed needs a drafter (the embedded model ships one; else pass --draft)")
    tok, target = rt.tokenizer, rt.target
    prompts = [tok.chat(m) for m in humaneval_messages(args.prompts)]
    prompts += depth_prompts(tok, args.long_depth, 1)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    max_new, ctx = args.max_new_tokens, rt.engine.max_ctx
    engines = {
        "deepflash plain": lambda: Engine(target, tok, config=EngineConfig(max_ctx=ctx)),
        "deepflash dflash (spec auto)": lambda: Engine(target, tok, rt.drafter, config=EngineConfig(max_ctx=ctx, spec="auto")),
        "deepflash dflash (spec on)": lambda: Engine(target, tok, rt.drafter, config=EngineConfig(max_ctx=ctx, spec="on")),
        # a shorter block: a cheaper verify and draft against the drafts past position 8 (HumanEval: 3% of
        # the AL with the shipped drafter)
        "deepflash dflash block 8 (spec on)": lambda: Engine(target, tok, rt.drafter, config=EngineConfig(max_ctx=ctx, spec="on", block_size=8)),
        # plain steps that still capture features for the drafter: what that capture costs on its own
        "deepflash dflash (spec off)": lambda: Engine(target, tok, rt.drafter, config=EngineConfig(max_ctx=ctx, spec="off")),
        "deepflash never-matching drafter (spec auto)": lambda: Engine(target, tok, never_matching_drafter(rt.drafter), config=EngineConfig(max_ctx=ctx, spec="auto")),
        "deepflash plain" + TORCH_KERNELS: lambda: Engine(target, tok, config=EngineConfig(max_ctx=ctx, target_kernels="torch")),
        "deepflash dflash (spec auto)" + TORCH_KERNELS: lambda: Engine(target, tok, rt.drafter, config=EngineConfig(max_ctx=ctx, spec="auto", target_kernels="torch")),
    }
    transformers_runs = {
        "transformers generate": {},
        "transformers generate (static cache)": {"cache_implementation": "static"},
        "transformers prompt lookup (10)": {"prompt_lookup_num_tokens": 10},
    }
    wanted = {name.strip() for name in args.systems.split(",")} if args.systems else \
        {name for name in [*engines, *transformers_runs]
         if TORCH_KERNELS not in name or device.type == "cuda"}
    unknown = wanted - set(engines) - set(transformers_runs)
    if unknown:
        raise UserError(f"--systems: unknown {sorted(unknown)}; choose from {[*engines, *transformers_runs]}")
    wanted |= {"deepflash plain", *(plain_of(name) for name in wanted)}  # the baselines ratios and outputs are against
    results: dict[str, dict] = {}

    def attempt(name, fn):
        try:
            results[name] = fn()
        except Exception as err:  # noqa: BLE001 - one failed system must not lose the others
            results[name] = {"error": f"{type(err).__name__}: {err}"}

    for name, make in engines.items():
        if name in wanted:
            attempt(name, lambda: run_engine(make(), prompts, max_new, params))
    if wanted & set(transformers_runs):
        from transformers import AutoModelForCausalLM

        from ..loading.weights import gguf_file, resolve_model

        gguf = gguf_file(args.model)  # transformers dequantizes a GGUF file itself
        source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name} if gguf else {
            "pretrained_model_name_or_path": str(resolve_model(args.model))}
        hf = AutoModelForCausalLM.from_pretrained(**source, dtype=target.dtype).to(device)
        for name, kwargs in transformers_runs.items():
            if name in wanted:
                attempt(name, lambda: run_transformers(hf, prompts, max_new, **kwargs))
        del hf
    if device.type == "cuda" and args.part == "all":
        attempt("qwen3-8b-shaped plain decode", lambda: qwen3_8b_mbu(device, bandwidth))
    base = results["deepflash plain"].get("tok_per_s")
    references = {name: r.get("outputs") for name, r in results.items()}
    rows = []
    for name, r in results.items():
        ratio = r["tok_per_s"] / base if base and "tok_per_s" in r else None
        outputs = r.get("outputs")  # kept in the JSON: greedy outputs compare across runs and commits
        reference = references.get(plain_of(name))
        if name.startswith("deepflash") and outputs is not None and reference is not None:
            # greedy: every deepflash system must match plain decode on the same kernels token for token
            # (transformers' outputs follow their own stop rules and kernels, so they are not compared)
            r["same_output_as_our_plain"] = sum(a == b for a, b in zip(outputs, reference))
        rows.append([name, r.get("tok_per_s", r.get("decode_tok_per_s", r.get("error", "-"))),
                     ratio if ratio is not None else "-", r.get("decode_tok_per_s", "-") if "tok_per_s" in r else "-",
                     1e3 * r["prefill_s"] if "prefill_s" in r else "-", r.get("acceptance_length", "-"),
                     f"{r['spec_steps']} / {r['plain_steps']}" if "spec_steps" in r else "-", r.get("mbu", "-"),
                     f"{r['same_output_as_our_plain']}/{len(prompts)}" if "same_output_as_our_plain" in r else "-"])
    table(f"speed: {len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy; outputs compared with our "
          f"plain decode on the same target kernels (plain on torch's kernels: with plain on the default ones)",
          ["system", "tok/s", "vs our plain", "decode tok/s", "prefill ms (all prompts)", "AL", "spec / plain steps",
           "MBU", "same output as our plain"], rows)
    record = {"bench": "speed", **environment(device), "copy_bandwidth_gb_s": bandwidth, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "results": results}
    return finish(record, args.out)


def plain_of(name: str) -> str:
    """The plain decode a system's greedy output must equal: the one on the same target kernels. Plain
    on torch's kernels is compared with plain on the default ones: bf16 rounding may differ between them."""
    if name.endswith(TORCH_KERNELS) and name != "deepflash plain" + TORCH_KERNELS:
        return "deepflash plain" + TORCH_KERNELS
    return "deepflash plain"


def register(sub) -> None:
    p = sub.add_parser("speed", help="tok/s of plain decode, DFlash and transformers baselines; MBU")
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=int, default=20, help="HumanEval prompts (plus one long code-edit prompt)")
    p.add_argument("--long-depth", type=int, default=6000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--systems", help="comma list of the systems' names as the table shows them (default: all); "
                                     "our plain decode always runs")
    p.add_argument("--part", default="all", choices=["all", "engines", "mbu"],
                   help="engines: the embedded pair and transformers; mbu: the --shape model only")
    p.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", *WIDE_SHAPES],
                   help="the random bf16 target of --part mbu (the wide ones with fewer layers, the DFlash step too)")
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
