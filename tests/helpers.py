"""Tiny in-process models and tokenizers for the tests (no network, no files)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepflash.drafter.checkpoint import save_drafter
from deepflash.drafter.config import DrafterConfig
from deepflash.drafter.model import DFlashDrafter
from deepflash.loading.tokenizer import Tokenizer, word_tokenizer
from deepflash.models import init_random_, materialize, random_model
from deepflash.models.config import ModelConfig

VOCAB = 96
EOS = 1


def tiny_tokenizer(vocab: int = VOCAB) -> Tokenizer:
    """Word-level tokenizer over 'w0'..'wN'; id 1 is the end token, with a minimal chat template."""
    return word_tokenizer(vocab, EOS)


def llama_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(llama_config_dict(**overrides))


def llama_config_dict(**overrides) -> dict:
    cfg = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
               tie_word_embeddings=True, eos_token_id=EOS)
    cfg.update(overrides)
    return cfg


def tiny_target(dtype=torch.float64, seed=0, std=0.2, **overrides):
    return random_model(llama_config(**overrides), dtype=dtype, seed=seed, std=std)


def tiny_target_and_tokenizer(device: torch.device):
    """The training tests' target (tiny_target in float32) and tokenizer: what a training worker loads."""
    return tiny_target(dtype=torch.float32).to(device), tiny_tokenizer()


def drafter_config(target_cfg: ModelConfig, layers: int = 2, block_size: int = 16, sliding: bool = False,
                   window: int = 8, taps=(0, 2), **overrides) -> DrafterConfig:
    types = ["sliding_attention" if sliding and i < layers - 1 else "full_attention" for i in range(layers)]
    cfg = dict(architectures=["DFlashDraftModel"], hidden_size=target_cfg.hidden_size, intermediate_size=96,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=target_cfg.max_position_embeddings,
               layer_types=types, sliding_window=window, block_size=block_size,
               num_target_layers=target_cfg.num_layers, vocab_size=target_cfg.vocab_size,
               dflash_config={"mask_token_id": target_cfg.vocab_size - 1, "target_layer_ids": list(taps)})
    cfg.update(overrides)
    return DrafterConfig.from_hf(cfg)


def tiny_drafter(cfg: DrafterConfig, dtype=torch.float64, seed=1, std=0.2, fused: bool = True) -> DFlashDrafter:
    """fused: the inference form load_drafter gives (one GEMM for q/k/v, one for gate/up)."""
    drafter = DFlashDrafter(cfg).to(dtype)
    init_random_(drafter, seed, std)
    drafter = materialize(drafter, "cpu").eval().requires_grad_(False)
    return drafter.fuse_projections() if fused else drafter


_TRAIN_DATA: dict = {}  # the session's tmp_path_factory, the folder, the summary


def train_dataset(tmp_path_factory):
    """The training tests' dataset: 8 chats of 12 to 60 words answered by tiny_target in float32 (half of
    them sampled), in shards of 3. Built once per session (the tests only read its files) under the
    session's temporary folder; each call gets a target and tokenizer of its own. Returns (target,
    tokenizer, folder, build_dataset's summary)."""
    from deepflash.train.datagen import build_dataset
    from deepflash.train.prompts import Task

    target, tok = tiny_target(dtype=torch.float32), tiny_tokenizer()
    if _TRAIN_DATA.get("factory") is not tmp_path_factory:
        rng = torch.Generator().manual_seed(0)
        tasks = [Task("test", "x", [{"role": "user", "content": " ".join(f"w{int(i)}" for i in
                                                                       torch.randint(5, 90, (n,), generator=rng))}])
                 for n in [20, 35, 50, 12, 60, 40, 25, 45]]
        out = tmp_path_factory.mktemp("data")
        summary = build_dataset(target, tok, tasks, out, max_new_tokens=40, max_len=160, sampled_fraction=0.5,
                                shard_size=3)
        _TRAIN_DATA.update(factory=tmp_path_factory, folder=out, summary=summary)
    return target, tok, _TRAIN_DATA["folder"], _TRAIN_DATA["summary"]


def save_tiny_model(folder: Path, **overrides) -> Path:
    """A tiny model folder as users have them: config.json, model.safetensors, tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llama_config_dict(**overrides)
    model = random_model(ModelConfig.from_hf(cfg), std=0.2)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    tiny_tokenizer().hf.save_pretrained(str(folder))
    return folder


def save_tiny_drafter(folder: Path, **overrides) -> Path:
    save_drafter(tiny_drafter(drafter_config(llama_config(), **overrides), dtype=torch.float32), folder,
                 dtype=torch.float32)
    return folder


def oracle(monkeypatch, reference: list[int], prompt_len: int, wrong_every: int = 0) -> None:
    """Replace the drafter's proposals by the true continuation (optionally spoiled now and then at
    shifting offsets), so that long accepted runs, every accepted length, and stops and length limits
    inside a block get exercised."""
    import deepflash.engine.steps as spec_module

    calls = {"n": 0}

    def propose(drafter, target, context, block, q_pos, span, out):
        start, size = int(q_pos[0]), q_pos.shape[0]
        calls["n"] += 1
        tokens = []
        for k in range(1, size):
            i = start + k - prompt_len
            tok = reference[i] if i < len(reference) else 5
            if wrong_every and (calls["n"] + k) % wrong_every == 0:
                tok = (tok + 1) % 90
            tokens.append(tok)
        return out.copy_(torch.tensor(tokens))

    monkeypatch.setattr(spec_module, "propose", propose)


def reference_probs(logits: torch.Tensor, params, margin: float = 1e-4) -> torch.Tensor:
    """The distribution a token sampled with `params` follows, written apart from deepflash's sampling code
    (float64): softmax(logits / temperature) cut to the top_k most likely tokens, then to the shortest
    prefix of them (in descending order, renormalised) whose mass reaches top_p, renormalised. A cut
    that decides the result must clear its boundary by `margin` (a float32 sampler could fall either side
    of a closer one)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if 0 < params.top_k < len(ordered):
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        kept = torch.where(keep, ordered, 0.0) / ordered[keep].sum()
        before = kept.cumsum(0) - kept  # the mass ahead of each token: it stays while that is below top_p
        assert (before[keep] - params.top_p).abs().min() > margin, "a token's mass sits at the top-p boundary"
        keep &= before < params.top_p
    if 0 < params.top_k < len(ordered) and keep[params.top_k - 1]:
        assert ordered[params.top_k - 1] - ordered[params.top_k] > margin, "tokens tie at the top-k boundary"
    out = torch.zeros_like(probs)
    out[order[keep]] = ordered[keep] / ordered[keep].sum()
    return out


def sequence_probs(target, prompt: list[int], length: int, params,
                   margin: float = 1e-4) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation of `prompt` of `length` tokens sampled with `params`
    (reference_probs at each step, `margin` passed on; one target forward per prefix of nonzero
    probability)."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        longer = {}
        for prefix, p in probs.items():
            ids = prompt + list(prefix)
            with torch.no_grad():
                logits = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, len(ids)))[0][0, -1]
            q = reference_probs(logits, params, margin)
            for token in torch.nonzero(q).flatten().tolist():
                longer[prefix + (token,)] = p * float(q[token])
        probs = longer
    return probs


@dataclass
class DistributionCheck:
    """Sampled continuations against their exact distribution `probs` (sequence_probs). Three tests:
    `impossible` samples (probability 0: a token a cut excludes, or one after a wrong context); a
    sequential chi-square, which checks each token against its exact distribution given the tokens before
    it (next-token counts after every sampled prefix; cells expecting fewer than 5 pooled), so that a
    wrong context (a rejected draft left in the cache, a wrong token fed to the next step) or noise shared
    between steps shows; and a likelihood score test (the samples' summed log-probability against its
    mean and variance under `probs`), which a sampler that is too hot or too cold moves by many
    deviations. p_value combines the last two (Bonferroni)."""

    samples: list[tuple[int, ...]]
    probs: dict[tuple[int, ...], float]
    accepted: list[int] = field(default_factory=list)  # drafts each run's first verify step accepted
    impossible: int = 0
    chi2: float = 0.0
    dof: int = 0
    p_chi2: float = 1.0
    z: float = 0.0
    p_score: float = 1.0

    def __post_init__(self):
        probs = self.probs = {seq: p for seq, p in self.probs.items() if p > 0}
        length = len(next(iter(probs)))
        self.impossible = sum(probs.get(s, 0.0) == 0.0 for s in self.samples)
        prefix_probs: dict[tuple[int, ...], float] = {}
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for seq, p in probs.items():
            for k in range(length + 1):
                prefix_probs[seq[:k]] = prefix_probs.get(seq[:k], 0.0) + p
                if k and seq[:k] not in children.setdefault(seq[: k - 1], []):
                    children[seq[: k - 1]].append(seq[:k])
        seen: dict[tuple[int, ...], int] = {}
        for s in self.samples:
            for k in range(length + 1):
                seen[s[:k]] = seen.get(s[:k], 0) + 1
        for prefix, n in seen.items():
            if len(prefix) < length and prefix in prefix_probs:
                kids = children[prefix]
                chi2, dof = _pooled_chi2([seen.get(c, 0) for c in kids],
                                         [prefix_probs[c] / prefix_probs[prefix] for c in kids], n)
                self.chi2, self.dof = self.chi2 + chi2, self.dof + dof
        if self.dof:
            self.p_chi2 = float(torch.special.gammaincc(torch.tensor(self.dof / 2, dtype=torch.float64),
                                                        torch.tensor(self.chi2 / 2, dtype=torch.float64)))
        logp = torch.tensor(list(probs.values()), dtype=torch.float64).log()
        p = logp.exp()
        mean, var = float((p * logp).sum()), float((p * logp**2).sum() - (p * logp).sum() ** 2)
        total = sum(math.log(probs[s]) for s in self.samples if probs.get(s, 0.0) > 0)
        self.z = (total - len(self.samples) * mean) / math.sqrt(len(self.samples) * var)
        self.p_score = math.erfc(abs(self.z) / math.sqrt(2))

    @property
    def p_value(self) -> float:
        """Of the chi-square and the score test together (Bonferroni); 0 when a sample was impossible."""
        return 0.0 if self.impossible else min(1.0, 2 * min(self.p_chi2, self.p_score))

    def __repr__(self) -> str:
        return (f"DistributionCheck({len(self.samples)} samples over {len(self.probs)} continuations: impossible "
                f"{self.impossible}, chi2 {self.chi2:.1f} on {self.dof} dof (p {self.p_chi2:.2g}), score z "
                f"{self.z:.2f} (p {self.p_score:.2g}), p {self.p_value:.2g})")


def _pooled_chi2(observed: list[int], probs: list[float], n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of n draws over cells of probabilities `probs`: cells
    expecting at least 5 draws, the rest pooled into one (or into the least likely of those where the
    pool expects fewer than 5); (0, 0) where that leaves a single cell."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    p = torch.tensor([probs[i] for i in order], dtype=torch.float64)
    o = torch.tensor([observed[i] for i in order], dtype=torch.float64)
    big = max(int((p * n >= 5).sum()), 1)
    o, e = torch.cat([o[:big], o[big:].sum()[None]]), torch.cat([p[:big], p[big:].sum()[None]]) * n
    if e[-1] < 5:
        o, e = torch.cat([o[:-2], o[-2:].sum()[None]]), torch.cat([e[:-2], e[-2:].sum()[None]])
    if len(e) < 2:
        return 0.0, 0
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def sampled_distribution_check(engine, monkeypatch, params, runs: int, length: int = 4,
                               propose_modes: bool = False) -> DistributionCheck:
    """Sample `length` tokens after a fixed prompt `runs` times (seeds 0..runs-1, so the check is
    deterministic) with `params`' temperature, top-k and top-p, and check them against the target's exact
    distribution (sequence_probs). With `propose_modes` the drafter proposes the most likely tokens
    (whatever the first token was), so that the first verify step accepts none, some or all of its drafts
    and the acceptance decides the output."""
    from deepflash.engine import steps
    from deepflash.engine.sampling import SamplingParams

    engine.stop_ids = frozenset()  # every run yields `length` tokens
    prompt = [4, 7, 5]
    probs = sequence_probs(engine.target, prompt, length, params)
    if propose_modes:  # position by position, the most likely token after the drafts before it
        modes, drafts = {}, ()
        for k in range(1, length):
            mass: dict[int, float] = {}
            for seq, p in probs.items():
                if seq[1:k] == drafts:
                    mass[seq[k]] = mass.get(seq[k], 0.0) + p
            drafts += (max(mass, key=mass.get),)
            modes[len(prompt) + k] = drafts[-1]
        monkeypatch.setattr(steps, "propose", lambda d, t, c, last, q_pos, span, out: out.copy_(torch.tensor(
            [modes.get(int(q_pos[0]) + k, 0) for k in range(1, q_pos.shape[0])])))
    samples, accepted = [], []
    for seed in range(runs):
        out = engine.complete(prompt, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                     top_p=params.top_p, max_new_tokens=length, seed=seed))
        samples.append(tuple(out.token_ids[:length]))
        if out.spec is not None and out.spec.trace:
            accepted.append(out.spec.trace[0] - 1)
    return DistributionCheck(samples, probs, accepted)


def check_left_padded_batch(model, vocab: int, tol: float) -> None:
    """Batched prompts of different lengths (left-padded, key mask) equal one-by-one runs: how training
    data is generated."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, vocab, (9,), generator=gen), torch.randint(0, vocab, (5,), generator=gen)
    batch = torch.stack([a, torch.cat([torch.zeros(4, dtype=torch.long), b])])
    key_mask = torch.ones(2, 64, dtype=torch.bool)
    key_mask[1, :4] = False
    with torch.no_grad():
        logits, _ = model(batch, torch.arange(9), model.new_cache(2, 64), key_mask=key_mask)
        la, _ = model(a[None], torch.arange(9), model.new_cache(1, 64))
        lb, _ = model(b[None], torch.arange(5), model.new_cache(1, 64))
    assert (logits[0] - la[0]).abs().max() <= tol
    assert (logits[1, 4:] - lb[0]).abs().max() <= tol


def triton_device() -> str:
    """For test modules of Triton kernels, called at import: the device to run them on. Without CUDA
    they run in Triton's interpreter, switched on here before Triton is first imported (its standard
    library is defined under the switch too); without Triton (torch's CPU builds) the module skips."""
    import importlib.util
    import os
    import sys

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (torch CPU builds lack it); the GPU chain runs these tests",
                    allow_module_level=True)
    if torch.cuda.is_available():
        return "cuda"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported (by torch.compile) before these tests could switch on its "
                    "interpreter; run this file alone on a CPU machine", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


DOCTEST = 'def double(x):\n    """Twice x.\n\n    >>> double(2)\n    4\n    """\n    y = 2 * x\n    return y\n'


def site_packages(tmp_path, monkeypatch, text_of):
    """prompts with site-packages replaced by 40 files, file i holding text_of(i)."""
    import deepflash.train.prompts as prompts

    files = [tmp_path / f"m{i}.py" for i in range(40)]
    for i, f in enumerate(files):
        f.write_text(text_of(i))
    monkeypatch.setattr(prompts, "site_package_files", lambda: list(files))
    return prompts


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer (256 ids, no merges) that round-trips any text, with a chat template that
    knows only roles and contents: for server tests whose prompts must be read back as text."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = RawTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw)
    hf.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    return Tokenizer(hf)


HYBRID_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def text_config(kind: str, **overrides) -> dict:
    """A tiny Qwen3.5 text config; k and v head dims differ so that a swapped axis cannot pass."""
    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=5, layer_types=HYBRID_TYPES, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               max_position_embeddings=512, eos_token_id=EOS,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    if kind == "moe":
        cfg.update(model_type="qwen3_5_moe_text", moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   num_experts=8, num_experts_per_tok=2)
    else:
        cfg.update(model_type="qwen3_5_text", intermediate_size=96)
    cfg.update(overrides)
    return cfg


def hybrid_target(kind: str, dtype=torch.float64, seed=0, std=0.2, **overrides):
    """A random hybrid target over the helpers' tiny vocabulary (for the engine tests)."""
    cfg = text_config(kind, **{"vocab_size": VOCAB, "tie_word_embeddings": True, **overrides})
    return random_model(ModelConfig.from_hf(cfg), dtype=dtype, seed=seed, std=std)


def hf_qwen35(kind: str, **overrides):
    """A transformers Qwen3.5 text model ("dense" or "moe") of text_config's tiny shape with random weights:
    N(0, 0.1) matrices and norm offsets moved by N(0, 0.1), larger than the default init so that mismatches
    show."""
    import transformers

    cfg = text_config(kind, **overrides)
    cfg.pop("model_type")
    if kind == "moe":
        hf_cfg, cls = transformers.Qwen3_5MoeTextConfig(**cfg), transformers.Qwen3_5MoeForCausalLM
    else:
        hf_cfg, cls = transformers.Qwen3_5TextConfig(**cfg), transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    hf = cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.1)
    return hf
