"""Tokenizers behind one small interface: a byte-level BPE for the from-scratch GPT, trained with
the `tokenizers` library (digits split into single tokens, as LLaMA does: multi-digit merges make
arithmetic much harder to learn), and an adapter for any Hugging Face tokenizer.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``pad_id``, ``eos_id``,
``vocab_size`` and ``save(folder)``; the rest of the pipeline sees nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from pipeline.rewards.parsing import ANSWER_CLOSE, ANSWER_OPEN  # the answer tags, one token each

PAD = "<|pad|>"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, EOS, ANSWER_OPEN, ANSWER_CLOSE]
TOKENIZER_FILE = "tokenizer.json"


class BPETokenizer:
    """Wraps a `tokenizers.Tokenizer` trained by :func:`train_tokenizer`."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.pad_id = tok.token_to_id(PAD)
        self.eos_id = tok.token_to_id(EOS)
        if self.pad_id is None or self.eos_id is None:
            raise ValueError(f"tokenizer lacks the special tokens {PAD} and {EOS}")
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [i for i in ids if i != self.pad_id and i != self.eos_id]
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / TOKENIZER_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self._tok.to_str(pretty=True))
        os.replace(tmp, path)
        return path

    def to_str(self) -> str:
        return self._tok.to_str()


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE with single-digit tokens and the special tokens above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return BPETokenizer(tok)


def load_tokenizer(path: str | Path) -> BPETokenizer:
    """Load `tokenizer.json` (or a folder holding it); a clear error names the file if it is bad."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer not found (run the prepare stage first)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"{path}: not a valid tokenizer file ({exc})") from None
    return BPETokenizer(tok)


def tokenizer_from_str(text: str) -> BPETokenizer:
    from tokenizers import Tokenizer

    return BPETokenizer(Tokenizer.from_str(text))


class HFTokenizer:
    """The pipeline tokenizer interface over a transformers tokenizer."""

    def __init__(self, tok) -> None:
        self.hf = tok
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r} has no eos token")
        self.eos_id = int(tok.eos_token_id)
        self.eos_ids = [self.eos_id]  # with a model's end-of-turn ids (add_eos_ids): what ends a completion
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)

    def add_eos_ids(self, ids: Iterable[int]) -> None:
        """Also end a completion at `ids` (a model's generation_config eos ids: an instruct model's
        end-of-turn tokens), and strip them in `decode` like eos."""
        self.eos_ids += [int(i) for i in ids if int(i) not in self.eos_ids]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:  # transformers' fast tokenizers fail on an empty batch
            return []
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` without pads and stop tokens (eos, end-of-turn), which end a response
        but are no part of its text."""
        drop = {self.pad_id, *self.eos_ids}
        return self.hf.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def chat_prompt(self, user: str, system: str = "", examples: Iterable[tuple[str, str]] = ()) -> str:
        """`user` as the user turn (after a `system` turn if given, and after `examples`, earlier
        (user, assistant) turns of a few-shot prompt), rendered with the tokenizer's chat template
        with the assistant turn opened: the text the model continues."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(self.hf, 'name_or_path', '')!r} has no chat template")
        messages = [{"role": "system", "content": system}] if system else []
        for question, answer in examples:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": user})
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_id(self, token: str) -> int | None:
        """Id of `token` if it is a single token of the vocabulary, else None."""
        i = self.hf.convert_tokens_to_ids(token)
        if i is None or (self.hf.unk_token_id is not None and i == self.hf.unk_token_id):
            return None
        return int(i)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        self.hf.save_pretrained(folder)
        return folder

    def to_str(self) -> str | None:
        backend = getattr(self.hf, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None


def load_hf_tokenizer(init: str | Path) -> HFTokenizer:
    """The tokenizer of a local folder or hub id (pad = eos where it has no pad token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(init))
    if tok.pad_token_id is None:  # many causal LMs ship without a pad token
        tok.pad_token = tok.eos_token
    return HFTokenizer(tok)
