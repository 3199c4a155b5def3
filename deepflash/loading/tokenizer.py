"""Tokenizer, chat template and streaming detokenisation (transformers' tokenizers do the real work)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

# Tokens that end a turn in common chat templates, used as stop tokens when the vocabulary has them.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")


def load_tokenizer(folder: Path | str) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        return Tokenizer(AutoTokenizer.from_pretrained(str(folder)))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load a tokenizer from {folder}: {err}") from None


class Tokenizer:
    """A transformers tokenizer plus what the engine asks of it."""

    def __init__(self, hf):
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Ids of a conversation rendered by the model's chat template, ready for the assistant's turn."""
        return self.chats([messages], **template_kwargs)[0]

    def chats(self, conversations: list[list[dict]], **template_kwargs) -> list[list[int]]:
        """chat() for many conversations: one batched encode, which a fast tokenizer spreads over threads."""
        if not conversations:  # (the fast tokenizer fails on an empty batch) e.g. training data of recall prompts
            return []
        for m in (m for messages in conversations for m in messages):
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise UserError("each message needs a role (system, user or assistant) and a string content")
        texts = [self.template_text(messages, **template_kwargs) for messages in conversations]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def template_text(self, messages: list[dict], **template_kwargs) -> str:
        """A conversation rendered by the model's chat template as text, ending with the assistant's turn
        opened (template_kwargs: tools, enable_thinking, ... for templates that take them)."""
        if not self.hf.chat_template:
            raise UserError("this model has no chat template; pass --raw to send the prompt as plain text")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **template_kwargs)
        except Exception as err:  # the template's own checks (jinja2's TemplateError, TypeError on a None)
            raise UserError(f"the model's chat template cannot render these messages: {err}") from None

    def encode_text(self, text: str) -> list[int]:
        """Ids of text a chat template rendered (which holds its special tokens already)."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def stop_ids(self, model_eos: tuple[int, ...] = ()) -> frozenset[int]:
        ids = set(model_eos)
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        vocab = self.hf.get_vocab()
        ids.update(vocab[t] for t in CHAT_END_TOKENS if t in vocab)
        return frozenset(ids)


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        text = decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]


def word_tokenizer(vocab: int, eos: int = 1) -> Tokenizer:
    """A word-level tokenizer over 'w0'..'wN' (id `eos` is '<eos>') with a minimal chat template, for
    random-weight models in tests and cost benchmarks, where no real vocabulary exists."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    del words[f"w{eos}"]
    words["<eos>"] = eos
    raw = RawTokenizer(models.WordLevel(words, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="w0")
    hf.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}w4"
    return Tokenizer(hf)
