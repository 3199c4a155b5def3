"""deepflash bench families: each target family checked end to end on one device.

Families: Qwen3 dense (the llama family's form), Qwen3-MoE, Qwen3.5 dense and Qwen3.5 / 3.6 MoE (hybrids of
Gated DeltaNet and gated attention). Sizes: `tiny` (4 layers, small widths, 1024-token vocabulary) and `wide`
(the real hidden, head and expert widths and vocabulary of Qwen3-8B, Qwen3-30B-A3B, Qwen3.5-27B and
Qwen3.6-35B-A3B with 4 layers: each fits one 80 GB GPU). Per family and size:
- logits (tiny only): transformers models of the family with random weights (8 seeds, each with its own
  random prompt), ours loaded from their state dicts; the logits at every position. Pass in float32: max abs
  difference <= 1e-4. Pass in 16-bit dtypes: mean cosine over all positions >= 0.999 to transformers in that
  dtype, or our distance to transformers in float32 (1 - mean cosine) at most 1.5x that of transformers' own
  run in that dtype: we round about as well as the reference. Two 16-bit runs that round at other points part
  where a hybrid's recurrence carries a token's rounding on, or where an MoE token's top-k sits near a tie and
  flips in one run (a flipped token's cosine can fall to 0.5), so their cosine alone can miss the mark while
  each is as close to float32 as the other. Flips are chance events (one seed's ratio of the two distances
  ranged over 0.6-2.8 across 8 seeds for the same Qwen3.5-MoE code), so the check takes the mean over the
  seeds, which the 1.5x allows for (a wrong layer costs far more). A logits row that the cosine alone does not
  pass is shown with both cosines to float32.
- spec == plain: greedy output of a speculative engine (a random DFlash drafter shaped for the target, spec on,
  block 16) against a plain engine's on the same random prompt, token for token; the random target's output
  follows its context, so that a wrong cache or state shows.
- memory (CUDA): the speculative engine's peak allocation against its memory plan (reported, not judged).
A check that raises (a graph capture error) is a failed check with the exception's message; the other checks
still run. The command exits 0 either way: it is a report, whose last table line counts the failures.

    deepflash bench families --device cuda --out families.json
    deepflash bench families --device cpu --size tiny
"""

from __future__ import annotations

import gc
from dataclasses import replace
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..drafter.config import DrafterConfig
from ..drafter.model import DFlashDrafter
from ..engine.config import DTYPES, EngineConfig
from ..engine.engine import Engine
from ..engine.memory import mib, plan_memory
from ..engine.runtime import resolve_device, resolve_dtype
from ..engine.sampling import SamplingParams
from ..errors import UserError
from ..loading.targets import build_from_state
from ..loading.tokenizer import word_tokenizer
from ..models import init_random_, materialize, random_model
from ..models.base import TARGET_KERNELS
from ..models.config import ModelConfig
from .common import environment, finish, save, stdout, table

FAMILIES = ("qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe")
SIZES = ("tiny", "wide")
LAYERS = 4  # one period of the hybrids' layout: 3 Gated DeltaNet layers, then a full-attention one
HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]
BLOCK = 16
COSINE_MIN = 0.999  # 16-bit dtypes: ours and transformers round at other points, so digits differ, not direction
MAX_ABS = 1e-4  # float32: the same sums, in other orders
ROUNDING_SLACK = 1.5  # 16 bits: our distance to float32 against the reference's own (routing flips are chance)
LOGITS_SEEDS = 8  # random models and prompts the logits check averages over (one seed's flips decide too much)
TRANSFORMERS_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}

# The wide sizes' widths are those of the public config.json files on the Hugging Face hub (the Qwen3.5 /
# 3.6 ones under text_config): Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3.5-27B (whose layout Qwen3.6-27B
# keeps) and Qwen/Qwen3.6-35B-A3B (Qwen3.5-35B-A3B's shape, which transformers' Qwen3_5MoeTextConfig
# defaults to); only the depth is cut, to LAYERS.
WIDE = {
    "qwen3": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1e6),
    "qwen3-moe": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1e6),
    "qwen3.5": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                    max_position_embeddings=262144, rope_theta=1e7),
    "qwen3.5-moe": dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
                        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
                        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                        linear_value_head_dim=128, max_position_embeddings=262144, rope_theta=1e7),
}
# tiny: the families' structure at test widths; the DeltaNet's key and value head dims differ, so that a
# swapped axis cannot pass
TINY = {
    "qwen3": dict(model_type="qwen3", intermediate_size=128),
    "qwen3-moe": dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3.5": dict(model_type="qwen3_5_text", intermediate_size=96),
    "qwen3.5-moe": dict(model_type="qwen3_5_moe_text", moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        num_experts=8, num_experts_per_tok=2),
}
TINY_COMMON = dict(vocab_size=1024, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=4096, rope_theta=1e6)
TINY_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)


def family_shape(family: str, size: str, layers: int = LAYERS) -> dict:
    """The HF config dict of a family at a size and depth (a multiple of 4; rope as transformers 5 writes it:
    rope_parameters)."""
    hybrid = family.startswith("qwen3.5")
    shape = dict(WIDE[family]) if size == "wide" else {**TINY_COMMON, **(TINY_HYBRID if hybrid else {}),
                                                       **TINY[family]}
    rope = dict(rope_type="default", rope_theta=shape.pop("rope_theta"))
    if hybrid:  # rope on a quarter of each head's dims, as in every Qwen3.5 / 3.6 config
        rope["partial_rotary_factor"] = 0.25
        shape.update(layer_types=HYBRID_LAYERS * (layers // 4), linear_conv_kernel_dim=4)
    return dict(shape, num_hidden_layers=layers, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=rope)


def random_prompt(vocab: int, tokens: int, seed: int = 0) -> list[int]:
    """Ids below vocab - 1: the last id is the drafter's mask token."""
    return torch.randint(2, vocab - 1, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def transformers_model(shape: dict, seed: int = 0):
    """The family's transformers model on the CPU in float32 with random weights: N(0, 0.1), larger than
    its own init so that mismatches show; norms their initial value plus such noise, so that a norm read the
    wrong way (as an offset or as a scale) shows too."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in TRANSFORMERS_CLASSES[shape["model_type"]])
    config = config_class(**{k: v for k, v in shape.items() if k != "model_type"})
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            if "norm" in name:
                p.add_(noise)
            else:
                p.copy_(noise)
    return model


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The mean over positions (rows) of the cosine of their logits."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).mean())


@torch.no_grad()
def logits_parity(shape: dict, device: torch.device, dtype: torch.dtype, prompt_tokens: int,
                  kernels: str = "auto", seeds: int = LOGITS_SEEDS) -> dict:
    """Every position's logits of ours (on the engine's default target kernels), loaded from random transformers
    models' state dicts (one per seed, each with its own prompt), against those models', both in `dtype` on
    `device`. Both are also compared with transformers in float32: in 16 bits, how far its own run strays from
    float32 is the yardstick for ours (logits_pass). Cosines are means over all seeds' positions."""
    runs = [seed_logits(shape, device, dtype, prompt_tokens, kernels, seed) for seed in range(seeds)]
    got, want, float32 = (torch.cat(parts) for parts in zip(*runs))
    result = {"seeds": seeds, "max_abs": float((got - want).abs().max()), "cosine": cosine(got, want),
              "cosine_to_float32": cosine(got, float32), "transformers_cosine_to_float32": cosine(want, float32)}
    return {"ok": logits_pass(result, dtype), **result}


def seed_logits(shape: dict, device: torch.device, dtype: torch.dtype, prompt_tokens: int, kernels: str,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One seed's logits at every position, in float: ours, transformers' in `dtype`, transformers' in float32."""
    hf = transformers_model(shape, seed).to(device)
    tokens = torch.tensor([random_prompt(shape["vocab_size"], prompt_tokens, seed)], device=device)
    float32 = hf(tokens).logits[0]
    hf = hf.to(dtype)
    want = hf(tokens).logits[0].float()
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ours = build_from_state(cfg, dict(hf.state_dict()), device, dtype).use_kernels(kernels)
    del hf
    positions = torch.arange(prompt_tokens, device=device)
    got = ours(tokens, positions, ours.new_cache(1, prompt_tokens))[0][0].float()
    return got, want, float32


def logits_pass(result: dict, dtype: torch.dtype) -> bool:
    """float32: the same sums in other orders, so within MAX_ABS. 16 bits: cosine to transformers in that
    dtype >= COSINE_MIN, or our distance to transformers in float32 within ROUNDING_SLACK of its own 16-bit
    run's (see the module doc)."""
    if dtype.itemsize >= 4:
        return result["max_abs"] <= MAX_ABS
    ours, theirs = 1 - result["cosine_to_float32"], 1 - result["transformers_cosine_to_float32"]
    return result["cosine"] >= COSINE_MIN or ours <= ROUNDING_SLACK * theirs


def random_drafter_for(target, seed: int = 1) -> DFlashDrafter:
    """A DFlash drafter for the target with random weights: 2 layers of its hidden size (heads of 128, or
    16 at tiny widths), tapping a DeltaNet and the attention layer on the hybrids (layers 1 and 3)."""
    cfg = target.cfg
    head_dim = 128 if cfg.hidden_size >= 1024 else 16
    heads = cfg.hidden_size // head_dim
    drafter_cfg = DrafterConfig.from_hf(dict(
        architectures=["DFlashDraftModel"], hidden_size=cfg.hidden_size, intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size, num_target_layers=cfg.num_layers,
        dflash_config={"mask_token_id": cfg.vocab_size - 1, "target_layer_ids": [1, cfg.num_layers - 1],
                       "block_size": BLOCK}))
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_cfg).to(target.dtype)
    drafter = drafter.to_empty(device=target.device)
    init_random_(drafter, seed=seed, std=0.02, on_device=True)
    return materialize(drafter, target.device).eval().requires_grad_(False).fuse_projections()


def varied_target(shape: dict, device: torch.device, dtype: torch.dtype):
    """A random target whose greedy output follows both the last token and its context, so that a wrong cache
    or state shows: weights of std hidden^-1/2 (each projection keeps its input's scale, at any width) and
    embeddings of unit scale. With the benches' std of 0.02 for everything, a wide shape's layers (close to
    the context's mean, which barely moves from step to step) outweigh the token's embedding and greedy
    output repeats one token; unit embeddings over layers of std 0.02 make a tiny shape's output depend on
    the last token alone."""
    cfg = ModelConfig.from_hf(shape)
    target = random_model(cfg, device=device, dtype=dtype, seed=0, std=cfg.hidden_size**-0.5, on_device=True)
    target.model.embed_tokens.weight.mul_(cfg.hidden_size**0.5)
    return target


def greedy_output(engine: Engine, prompt: list[int], max_new: int):
    """The engine's greedy completion, all max_new tokens (random weights: no stop token ends it)."""
    engine.stop_ids = frozenset()
    result = engine.complete(prompt, SamplingParams(max_new_tokens=max_new))
    engine.wait_idle()
    return result


def with_peak(device: torch.device, fn: Callable):
    """fn()'s result and the peak device allocation while it ran, what was allocated before included (the
    weights: the plan counts them); None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (one ending early counts), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def spec_against_plain(shape: dict, device: torch.device, dtype: torch.dtype, prompt_tokens: int, max_new: int,
                       max_ctx: int, kernels: str = "auto") -> dict:
    """Greedy output of a speculative engine (random drafter, spec on) against a plain engine's, and the
    speculative engine's peak allocation against its memory plan. Speculative first: its peak is then not
    raised by a plain engine's buffers."""
    target = varied_target(shape, device, dtype)
    drafter = random_drafter_for(target)
    tokenizer = word_tokenizer(target.cfg.vocab_size)
    prompt = random_prompt(target.cfg.vocab_size, prompt_tokens)
    plain_config = EngineConfig(max_ctx=max_ctx, target_kernels=kernels)
    spec_config = replace(plain_config, spec="on", block_size=BLOCK)

    def speculative():
        return greedy_output(Engine(target, tokenizer, drafter, spec_config), prompt, max_new)

    spec, peak = with_peak(device, speculative)
    plain = greedy_output(Engine(target, tokenizer, config=plain_config), prompt, max_new)
    plan = plan_memory(target, drafter, max_ctx, spec_config, device).total
    first = first_difference(spec.token_ids, plain.token_ids)
    return {"ok": first is None, "first_difference": first, "spec_ids": spec.token_ids, "plain_ids": plain.token_ids,
            "spec_steps": spec.spec.steps, "acceptance_length": spec.spec.acceptance_length, "peak_bytes": peak,
            "plan_bytes": plan, "peak_over_plan": peak / plan if peak is not None else None}


def attempt(check: Callable[[], dict], device: torch.device) -> dict:
    """check()'s result, or a failed one with the exception's first line (and its traceback, for the JSON).
    What earlier checks left is freed first, inside the try: after a sticky CUDA error even that raises, and
    the later checks must still become rows."""
    try:
        release(device)
        return check()
    except Exception as err:  # noqa: BLE001 - one failing check (a graph capture error) must not stop the others
        message = str(err).strip().splitlines()
        return {"ok": False, "error": f"{type(err).__name__}: {message[0]}" if message else type(err).__name__,
                "traceback": traceback.format_exc()}


def release(device: torch.device) -> None:
    """Free what finished checks left (reference cycles), so that the next one's peak starts from its own
    allocations."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_family(family: str, size: str, device: torch.device, dtype: torch.dtype, prompt_tokens: int,
                 max_new: int, max_ctx: int, kernels: str = "auto", logits_seeds: int = LOGITS_SEEDS) -> dict:
    """One row: the logits check (tiny only: a transformers model beside ours at a wide shape would double the
    device memory) and the speculative-against-plain check with its memory, each on its own."""
    shape = family_shape(family, size)
    row = {"family": family, "size": size, "logits": None}
    if size == "tiny":
        row["logits"] = attempt(lambda: logits_parity(shape, device, dtype, prompt_tokens, kernels, logits_seeds),
                                device)
    row["spec"] = attempt(lambda: spec_against_plain(shape, device, dtype, prompt_tokens, max_new, max_ctx, kernels),
                          device)
    return row


def failures(row: dict) -> int:
    return sum(not check["ok"] for check in (row["logits"], row["spec"]) if check is not None)


def table_row(row: dict) -> list:
    logits, spec = row["logits"] or {}, row["spec"]
    errors = "; ".join(f"{name}: {check['error']}" for name, check in (("logits", logits), ("spec", spec))
                       if "error" in check)

    def verdict(check: dict) -> str:
        return "-" if not check else "error" if "error" in check else "yes" if check["ok"] else "NO"

    # printed in full: a cosine of 0.9989 must not read as 0.999
    max_abs, cosine = (f"{logits['max_abs']:.2e}", f"{logits['cosine']:.6f}") if "max_abs" in logits else ("-", "-")
    peak = (f"{mib(spec['peak_bytes']):.0f}/{mib(spec['plan_bytes']):.0f} MiB ({spec['peak_over_plan']:.2f})"
            if spec.get("peak_bytes") is not None else "-")
    first = spec.get("first_difference")
    return [row["family"], row["size"], verdict(logits), max_abs, cosine, verdict(spec),
            "-" if first is None else first, peak, errors or "-"]


def run(args) -> dict:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    families = [name.strip() for name in args.families.split(",")]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise UserError(f"--families: unknown {sorted(unknown)}; choose from {list(FAMILIES)}")
    if args.logits_seeds < 1:
        raise UserError(f"--logits-seeds must be at least 1, got {args.logits_seeds}")
    sizes = SIZES if args.size == "all" else (args.size,)
    record = {"bench": "families", **environment(device), "dtype": str(dtype).removeprefix("torch."),
              "target_kernels": args.target_kernels, "logits_seeds": args.logits_seeds,
              "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens, "max_ctx": args.max_ctx,
              "rows": []}
    for size in sizes:
        for family in families:
            record["rows"].append(check_family(family, size, device, dtype, args.prompt_tokens,
                                               args.max_new_tokens, args.max_ctx, args.target_kernels,
                                               args.logits_seeds))
            save(record, args.out)  # a later family that hangs or runs out of time keeps the finished rows
    record["checks"] = sum((row["logits"] is not None) + 1 for row in record["rows"])
    record["failures"] = sum(failures(row) for row in record["rows"])
    show(record)
    return finish(record, args.out)


def notes(row: dict) -> list[str]:
    """A row's errors, and the float32 yardstick of a logits check that the cosine alone does not pass (failed,
    or passed as rounding no worse than transformers), as lines of their own (a narrow console cuts the
    table's cells)."""
    name, logits = f"{row['family']} {row['size']}", row["logits"] or {}
    lines = [f"{name} {check}: {row[check]['error']}" for check in ("logits", "spec") if "error" in (row[check] or {})]
    if "cosine" in logits and (not logits["ok"] or logits["cosine"] < COSINE_MIN):
        lines.append(f"{name} logits: cosine {logits['cosine']:.6f} to transformers; to transformers in float32: ours "
                     f"{logits['cosine_to_float32']:.6f}, its own {logits['transformers_cosine_to_float32']:.6f}")
    return lines


def show(record: dict) -> None:
    """The table, the rows' notes, then the count of failed checks."""
    table(f"target families ({record['dtype']}): logits against transformers, greedy spec (block {BLOCK}) against "
          f"plain over {record['max_new_tokens']} tokens, peak memory against the plan",
          ["family", "size", "logits ok", "max abs", "cosine", "spec == plain", "first diff", "peak/plan", "error"],
          [table_row(row) for row in record["rows"]])
    for row in record["rows"]:
        for line in notes(row):
            stdout.print(line, soft_wrap=True)
    stdout.print(f"{record['failures']} of {record['checks']} checks failed")


def register(sub) -> None:
    p = sub.add_parser("families", help="each target family (dense, MoE, hybrid): logits against transformers, "
                                        "greedy spec == plain, peak memory against the plan")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bf16 on CUDA, float32 on CPU")
    p.add_argument("--size", default="all", choices=["all", *SIZES],
                   help="tiny: 4 layers of test widths; wide: 4 layers of the real models' widths")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--logits-seeds", type=int, default=LOGITS_SEEDS,
                   help="random models (each with its own prompt) the tiny logits check averages over")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-ctx", type=int, default=2048)
    p.add_argument("--target-kernels", default="auto", choices=TARGET_KERNELS, help="as generate's")
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
