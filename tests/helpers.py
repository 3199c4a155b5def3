"""Tiny in-process models and tokenizers for the tests (no network, no files)."""

from __future__ import annotations

import json
import math
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


def chi_square_p(counts: dict, probs: torch.Tensor, n: int) -> float:
    """p-value of observed counts against expected probabilities (bins with expectation < 5 merged)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square survival function
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def third_token_check(engine, monkeypatch, runs: int, propose_modes: bool) -> tuple[float, int]:
    """Sample 3 tokens after a fixed prompt `runs` times (seeds 0..runs-1); return the chi-square p-value
    of the third token against the target's exact distribution, and the drafts accepted. With
    `propose_modes` the drafter proposes each position's most likely token, so drafts are often (not
    always) accepted."""
    import deepflash.engine.steps as spec_module
    from deepflash.engine.sampling import SamplingParams, target_probs

    target, vocab = engine.target, engine.target.cfg.vocab_size
    engine.stop_ids = frozenset()  # every run yields exactly three tokens
    prompt = [4, 7, 5]
    params = SamplingParams(temperature=0.9, top_k=6, max_new_tokens=3)

    def probs(ids):
        with torch.no_grad():
            logits = target(torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(1, 8))[0][0, -1]
        return target_probs(logits, params).double()

    second = torch.zeros(vocab, dtype=torch.float64)
    third = torch.zeros(vocab, dtype=torch.float64)
    p1 = probs(prompt)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [t1])
        second += p1[t1] * p2
        for t2 in torch.nonzero(p2).flatten().tolist():
            third += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    if propose_modes:
        modes = {len(prompt) + 1: int(second.argmax()), len(prompt) + 2: int(third.argmax())}
        monkeypatch.setattr(spec_module, "propose", lambda d, t, c, last, q_pos, span, out: out.copy_(torch.tensor(
            [modes.get(int(q_pos[0]) + k, 0) for k in range(1, q_pos.shape[0])])))
    counts: dict[int, int] = {}
    accepted = 0
    for seed in range(runs):
        out = engine.complete(prompt, SamplingParams(temperature=0.9, top_k=6, max_new_tokens=3, seed=seed))
        counts[out.token_ids[2]] = counts.get(out.token_ids[2], 0) + 1
        accepted += out.spec.accepted_tokens if out.spec is not None else 0
    return chi_square_p(counts, third, runs), accepted


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
