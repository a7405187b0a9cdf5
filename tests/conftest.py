"""Small real fakes shared by the tests: a tiny BPE tokenizer, tiny policies of every backend.

Nothing here downloads: HF models are built from a config and saved to a temporary folder.
"""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """One torch thread: the tests' tensors are tiny, and on a small shared machine intra-op
    threads spin against other processes (a 10x slowdown under load, for no gain when idle)."""
    import torch

    torch.set_num_threads(1)


def arithmetic_texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        texts.append(f"Question: What is {a} {op} {b}?\nAnswer: {a} {op} {b} = "
                     f"<answer>{a + b if op == '+' else a - b}</answer><|endoftext|>")
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE (vocab 320) trained on a few hundred arithmetic strings."""
    from pipeline.tokenizer import train_tokenizer

    return train_tokenizer(arithmetic_texts(), vocab_size=320)


def tiny_model_config(**overrides):
    from pipeline.config import ModelConfig

    base = dict(backend="gpt", n_layer=2, n_head=2, n_embd=32, block_size=128, device="cpu")
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture
def gpt_policy(tiny_tokenizer):
    """A 2-layer, 32-wide from-scratch GPT policy with rope (random init, seeded)."""
    import torch

    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    return build_policy(tiny_model_config(), tiny_tokenizer)


def save_tiny_hf(folder, kind: str, tokenizer) -> str:
    """Build a tiny GPT-2 or Llama from a config, save it with a HF tokenizer; return the folder."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from pipeline.tokenizer import EOS, PAD

    torch.manual_seed(0)
    V = tokenizer.vocab_size
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                         bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),
                                     pad_token=PAD, eos_token=EOS)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory, tiny_tokenizer):
    """{'gpt2': folder, 'llama': folder} of tiny saved HF models."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny_hf(root / kind, kind, tiny_tokenizer) for kind in ("gpt2", "llama")}


@pytest.fixture(params=["gpt", "gpt-learned", "hf-gpt2", "hf-llama"])
def any_policy(request, tiny_tokenizer, hf_dirs):
    """The same tests over every backend: GPT (rope, learned) and HF (GPT-2, Llama)."""
    import torch

    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    if request.param == "gpt":
        return build_policy(tiny_model_config(), tiny_tokenizer)
    if request.param == "gpt-learned":
        return build_policy(tiny_model_config(positions="learned"), tiny_tokenizer)
    kind = request.param.split("-")[1]
    return build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
