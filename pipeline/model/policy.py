"""The one policy interface that rollout, SFT, GRPO and evaluation use, for both backends.

A :class:`Policy` wraps a module (the from-scratch :class:`~pipeline.model.gpt.GPT` or any
transformers causal LM), its tokenizer, the device and the compute dtype:

- ``policy.logits(input_ids, attention_mask) -> (B, T, V)``: padding-invariant (positions come
  from the mask), under bf16 autocast where configured, with grad if grad is enabled;
- ``policy.decoder(max_len)``: a KV-cached incremental decoder (``prefill``/``step``) for rollout;
- what a trainer needs: ``.module`` (for the optimizer / DDP), ``.runner`` (what ``logits`` calls:
  the module, or a DDP / ``torch.compile`` wrapper of it), ``.train()``/``.eval()``,
  ``.state_dict()``, ``.frozen_copy()`` (the reference model), ``.num_params()``.

Weights stay fp32 (master weights for AdamW); ``dtype`` only picks the autocast dtype:
``auto`` is bf16 on CUDA and fp32 on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn

from pipeline.config import ModelConfig
from pipeline.model.gpt import GPT, GPTConfig, GPTDecoder, positions_from_mask
from pipeline.tokenizer import ANSWER_CLOSE


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """`auto`/None: CUDA if available, else CPU; otherwise the named device."""
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_autocast(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Policy:
    """A causal LM + tokenizer on a device; see the module docstring for the interface."""

    def __init__(self, module: nn.Module, tokenizer, model_cfg: ModelConfig,
                 device: str | torch.device | None = None) -> None:
        self.backend = model_cfg.backend
        self.model_cfg = model_cfg
        self.device = resolve_device(device if device is not None else model_cfg.device)
        self.module = module.to(self.device)
        self.tokenizer = tokenizer
        self.autocast_dtype = resolve_autocast(model_cfg.dtype, self.device)
        self.runner = torch.compile(self.module) if model_cfg.compile else self.module

    # ------------------------------------------------------------------ forward

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids and 0/1 mask -> (B, T, V) next-token logits."""
        with self.autocast():
            if self.backend == "gpt":
                return self.runner(input_ids, attention_mask)
            positions = positions_from_mask(attention_mask)
            out = self.runner(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=positions, use_cache=False)
            return out.logits

    def decoder(self, max_len: int):
        """A fresh KV-cached decoder for sequences of at most `max_len` positions."""
        if self.backend == "gpt":
            return _Autocasting(GPTDecoder(self.module, max_len, self.autocast_dtype), self)
        from pipeline.model.hf import HFDecoder

        return _Autocasting(HFDecoder(self.module, max_len), self)

    @property
    def max_len(self) -> int | None:
        """Longest context the model supports (positions), if it says."""
        if self.backend == "gpt":
            return self.module.config.block_size
        cfg = self.module.config
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a completion: end-of-text, and `</answer>` if it is one token."""
        ids = [self.tokenizer.eos_id]
        close = self.tokenizer.token_id(ANSWER_CLOSE) if hasattr(self.tokenizer, "token_id") else None
        if close is not None and close not in ids:
            ids.append(close)
        return ids

    # ------------------------------------------------------------------ trainer helpers

    def train(self, mode: bool = True) -> Policy:
        self.module.train(mode)
        return self

    def eval(self) -> Policy:
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def frozen_copy(self) -> Policy:
        """An independent eval-mode copy with requires_grad off (the GRPO reference model)."""
        module = copy.deepcopy(self.module).eval().requires_grad_(False)
        cfg = dataclasses.replace(self.model_cfg, compile=False)
        return Policy(module, self.tokenizer, cfg, self.device)


class _Autocasting:
    """Runs a decoder's prefill/step under the policy's autocast."""

    def __init__(self, inner, policy: Policy) -> None:
        self.inner, self.policy = inner, policy

    def prefill(self, input_ids, attention_mask, position_ids, repeats: int) -> torch.Tensor:
        with self.policy.autocast():
            return self.inner.prefill(input_ids, attention_mask, position_ids, repeats).float()

    def step(self, tokens, positions) -> torch.Tensor:
        with self.policy.autocast():
            return self.inner.step(tokens, positions).float()


def build_policy(model_cfg: ModelConfig, tokenizer=None, device: str | torch.device | None = None) -> Policy:
    """A fresh policy from the config.

    `gpt`: a randomly initialised GPT sized by the config and `tokenizer.vocab_size` (to start from
    a saved checkpoint use :func:`pipeline.checkpoint.init_policy`). `hf`: the model and tokenizer
    of `model_cfg.init` (a folder or hub id); `tokenizer` is ignored.
    """
    if model_cfg.backend == "gpt":
        if tokenizer is None:
            raise ValueError("build_policy: the gpt backend needs a tokenizer (for its vocab_size)")
        module = GPT(GPTConfig.from_model_config(model_cfg, tokenizer.vocab_size))
        return Policy(module, tokenizer, model_cfg, device)
    if model_cfg.backend == "hf":
        if not model_cfg.init:
            raise ValueError("build_policy: backend 'hf' needs model.init = a HF model id or folder")
        from pipeline.model.hf import load_hf

        module, hf_tok = load_hf(model_cfg.init)
        return Policy(module, hf_tok, model_cfg, device)
    raise ValueError(f"model.backend = {model_cfg.backend!r}; allowed: gpt, hf")
