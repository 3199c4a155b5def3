"""deepflash bench agent: multi-turn agent conversations with and without the prefix cache.

Each turn re-sends the whole history plus a tool result and a user message, as a coding agent does, and asks
for a reply. Two engines over one model pair, one with the prefix cache and one without, answer every turn;
per turn: time to first token, prompt tokens computed, decode tok/s, acceptance length, and whether the
greedy text is the same. Parts:
- embedded: the embedded pair, 8 turns from ~3.5K to ~7K tokens (a shared project context, tool results from
  standard-library sources); then three such conversations interleaved turn by turn; then three with a small
  cache budget (evictions).
- qwen3-8b: a Qwen3-8B-shaped random bf16 target with a z-lab-shaped random drafter (window 40960), 8 turns
  from 20K to ~32K tokens (random tokens).

    deepflash bench agent --device cuda --out benchmarks/prefix-cache/agent.json
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from ..drafter.config import DrafterConfig
from ..drafter.model import DFlashDrafter
from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.runtime import load_runtime, resolve_device
from ..engine.sampling import SamplingParams
from ..loading.tokenizer import word_tokenizer
from ..models import init_random_, materialize
from ..train.prompts import stdlib_files
from .common import environment, finish, save, table
from .speed import QWEN3_8B, random_target

SYSTEM = "You are a coding agent. Read the tool results and answer briefly with the next step."
ZLAB_QWEN3_8B_DRAFTER = dict(architectures=["DFlashDraftModel"], hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                             vocab_size=151936, num_target_layers=36,
                             dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
                                            "block_size": 16})


class ChatConversation:
    """Messages through the tokenizer's chat template: a system prompt with a project's context (shared by
    every conversation, as an agent's is), a task of the conversation's own, then per turn a tool result (a
    slice of a standard-library module) and a question; the reply joins the history as the assistant's."""

    def __init__(self, tokenizer, seed: int, context_chars: int, tool_chars: int):
        self.tokenizer, self.rng, self.tool_chars = tokenizer, random.Random(seed), tool_chars
        self.files = stdlib_files()
        context = self.files[0].read_text(errors="replace")[:context_chars]
        self.messages = [{"role": "system", "content": f"{SYSTEM}\n\nProject context:\n```\n{context}```"},
                         {"role": "user", "content": f"Task {seed}: find where {self.rng.choice(self.files).stem} "
                                                     "parses its input."}]

    def prompt(self) -> list[int]:
        return self.tokenizer.chat(self.messages)

    def advance(self, reply_ids: list[int]) -> None:
        text = self.rng.choice(self.files).read_text(errors="replace")
        at = self.rng.randrange(max(1, len(text) - self.tool_chars))
        self.messages += [{"role": "assistant", "content": self.tokenizer.decode(reply_ids)},
                          {"role": "user", "content": f"Tool result:\n```\n{text[at : at + self.tool_chars]}```\n"
                                                      "What next?"}]


class TokenConversation:
    """Raw token ids (a random target has no template): the history, the reply, then `grow` new tokens."""

    def __init__(self, vocab: int, seed: int, first: int, grow: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.grow = vocab, grow
        self.ids = self._random(first)

    def _random(self, n: int) -> list[int]:
        return torch.randint(2, self.vocab, (n,), generator=self.gen).tolist()

    def prompt(self) -> list[int]:
        return list(self.ids)

    def advance(self, reply_ids: list[int]) -> None:
        self.ids += reply_ids + self._random(self.grow)


def turn(cached: Engine, cold: Engine, prompt: list[int], params: SamplingParams) -> tuple[dict, list[int]]:
    """One turn on both engines (each waits for its steps left in flight, so that the next turn's time to
    first token is its own)."""
    row = {"prompt_tokens": len(prompt)}
    reply = None
    for name, engine in (("cached", cached), ("cold", cold)):
        result = engine.complete(prompt, params)
        engine.wait_idle()
        spec = result.spec
        row[name] = {"ttft_s": result.prefill_s, "computed_tokens": len(prompt) - result.cached_tokens,
                     "decode_tok_per_s": result.tok_per_s,
                     "acceptance_length": spec.acceptance_length if spec is not None else None}
        reply = reply or result.token_ids
        row.setdefault("outputs", []).append(result.token_ids)
    outputs = row.pop("outputs")
    row["same_text"] = outputs[0] == outputs[1]
    row["ttft_ratio"] = row["cached"]["ttft_s"] / row["cold"]["ttft_s"]
    index = cached.prefix.index
    row["cache"] = {"device_bytes": index.device_bytes, "host_bytes": index.host_bytes,
                    "evictions": index.stats.evictions, "budget": index.device_budget}
    return row, reply


def conversation_rows(cached: Engine, cold: Engine, conversations: list, turns: int,
                      params: SamplingParams) -> list[dict]:
    """`turns` turns of each conversation, interleaved one turn at a time."""
    rows = []
    for t in range(turns):
        for c, talk in enumerate(conversations):
            row, reply = turn(cached, cold, talk.prompt(), params)
            rows.append({"conversation": c, "turn": t, **row})
            talk.advance(reply)
    return rows


def show(title: str, rows: list[dict]) -> None:
    def pair(r: dict, key: str, form: str, scale: float = 1.0) -> str:
        values = [r["cached"][key], r["cold"][key]]
        return "-" if None in values else "/".join(format(v * scale, form) for v in values)

    table(title + " (cached engine / cold engine)", ["turn", "prompt", "cached", "TTFT ms", "ratio", "tok/s", "AL",
                                                     "same", "MiB"],
          [[f"{r['conversation']}.{r['turn']}", r["prompt_tokens"], r["prompt_tokens"] - r["cached"]["computed_tokens"],
            pair(r, "ttft_s", ".0f", 1e3), r["ttft_ratio"], pair(r, "decode_tok_per_s", ".0f"),
            pair(r, "acceptance_length", ".2f"),
            "yes" if r["same_text"] else "NO", r["cache"]["device_bytes"] / 2**20] for r in rows])


def embedded_part(args, record: dict) -> None:
    base = EngineConfig(device=args.device, spec="on")
    rt = load_runtime(replace(base, prefix_cache=True))
    cold = Engine(rt.target, rt.tokenizer, rt.drafter, base)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def talk(seed: int) -> ChatConversation:
        return ChatConversation(rt.tokenizer, seed, args.context_chars, args.tool_chars)

    conversation_rows(rt.engine, cold, [talk(99)], 2, params)  # captures the graphs
    rt.engine.prefix.index.clear()
    parts = {"embedded, one conversation": [talk(0)], "embedded, three interleaved": [talk(s) for s in (1, 2, 3)]}
    for title, talks in parts.items():
        record["results"][title] = rows = conversation_rows(rt.engine, cold, talks, args.turns, params)
        show(title, rows)
        save(record, args.out)
    small = Engine(rt.target, rt.tokenizer, rt.drafter, replace(base, prefix_cache=True,
                                                                prefix_cache_mb=args.small_budget_mb))
    title = f"embedded, three interleaved, {args.small_budget_mb} MiB cache"
    record["results"][title] = rows = conversation_rows(small, cold, [talk(s) for s in (4, 5, 6)], args.turns, params)
    show(title, rows)


def random_drafter(device: torch.device) -> DFlashDrafter:
    cfg = DrafterConfig.from_hf(ZLAB_QWEN3_8B_DRAFTER)
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg).to(torch.bfloat16)
    drafter = drafter.to_empty(device=device)
    init_random_(drafter, seed=5, std=0.02)
    return materialize(drafter, device).eval().requires_grad_(False).fuse_projections()


def qwen3_8b_part(args, record: dict) -> None:
    device = resolve_device(args.device)
    target = random_target(QWEN3_8B, device)
    tokenizer = word_tokenizer(target.cfg.vocab_size)
    drafter = random_drafter(device)
    # bf16 features: the mirror is the ring itself (40960 rows of 5 x 4096)
    base = EngineConfig(spec="on", max_ctx=args.long_ctx, feature_dtype="bf16")
    cached = Engine(target, tokenizer, drafter, replace(base, prefix_cache=True))
    cold = Engine(target, tokenizer, drafter, base)
    for engine in (cached, cold):
        engine.stop_ids = frozenset()  # random weights: every turn generates max_new_tokens
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    grow = (args.long_ctx - args.long_start - 2048) // args.turns - args.max_new_tokens
    vocab = target.cfg.vocab_size
    conversation_rows(cached, cold, [TokenConversation(vocab, 99, args.long_start, grow)], 2, params)  # graphs
    cached.prefix.index.clear()
    title = "Qwen3-8B-shaped random target"
    rows = conversation_rows(cached, cold, [TokenConversation(vocab, 0, args.long_start, grow)], args.turns, params)
    record["results"][title] = rows
    show(title, rows)


def run(args) -> dict:
    device = resolve_device(args.device)
    record = {"bench": "agent", **environment(device), "turns": args.turns, "max_new_tokens": args.max_new_tokens,
              "results": {}}
    if args.part in ("all", "embedded"):
        embedded_part(args, record)
        save(record, args.out)
    if args.part in ("all", "qwen3-8b"):
        qwen3_8b_part(args, record)
    return finish(record, args.out)


def register(sub) -> None:
    p = sub.add_parser("agent", help="multi-turn agent conversations with and without the prefix cache")
    p.add_argument("--device", default="auto")
    p.add_argument("--part", default="all", choices=["all", "embedded", "qwen3-8b"])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--context-chars", type=int, default=9000, help="the embedded part's shared project context")
    p.add_argument("--tool-chars", type=int, default=1400, help="the embedded part's tool result per turn")
    p.add_argument("--long-ctx", type=int, default=34816, help="the Qwen3-8B-shaped part's context")
    p.add_argument("--long-start", type=int, default=20480, help="the Qwen3-8B-shaped part's first prompt")
    p.add_argument("--small-budget-mb", type=float, default=16.0, help="the eviction run's device budget")
    p.add_argument("--out", help="JSON file")
    p.set_defaults(func=run)
