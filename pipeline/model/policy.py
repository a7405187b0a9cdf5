"""The one policy interface that rollout, SFT, GRPO and evaluation use, for both backends.

A :class:`Policy` wraps a module (the from-scratch :class:`~pipeline.model.gpt.GPT` or any
transformers causal LM), its tokenizer, the device and the compute dtype:

- ``policy.logits(input_ids, attention_mask, logits_from=0) -> (B, T - logits_from, V)``:
  padding-invariant (positions come from the mask), under bf16 autocast where configured, with
  grad if grad is enabled; columns before `logits_from` skip the vocabulary projection;
- ``policy.token_logprobs(input_ids, attention_mask, temperature, start=, group_size=) -> (N, T)``:
  the per-token log-probs of the GRPO ratio and KL (see the method);
- ``policy.decoder(max_len)``: a KV-cached incremental decoder (``prefill``/``step``) for rollout;
- what a trainer needs: ``.module`` (for the optimizer / DDP), ``.runner`` (what ``logits`` calls:
  the module, or a DDP / ``torch.compile`` wrapper of it), ``.no_sync()`` (DDP's, else a null
  context), ``.train()``/``.eval()``,
  ``.state_dict()``, ``.frozen_copy()`` (the reference model), ``.num_params()``.

What differs per backend sits in one small ops class each (``GPTOps`` in ``pipeline.model.gpt``,
``HFOps`` in ``pipeline.model.hf``); nothing above this module names a backend to compute.

Weights are ``param_dtype`` (fp32 by default, stepped in place by AdamW; bf16 halves the weights and
the reference, while the optimizer keeps fp32 masters and moments of them:
``pipeline.train.optim.MasterAdamW``); ``dtype`` picks the autocast dtype: ``auto`` is bf16 on CUDA and
fp32 on CPU.
``gradient_checkpointing`` (hf) recomputes each layer in backward; the shared-prompt log-prob path,
whose cache a recomputation cannot replay, then gives way to the plain one under grad.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn

from pipeline.core.config import ModelConfig
from pipeline.data.tokenizer import ANSWER_CLOSE
from pipeline.model import fast
from pipeline.model.attention import positions_from_mask
from pipeline.model.gpt import GPT, GPTConfig, GPTOps
from pipeline.model.logprobs import gather_logprobs


COMPILE_BUCKET = 64  # widths a compiled forward sees are multiples of this


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """`auto`/None: CUDA if available, else CPU; otherwise the named device."""
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def param_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """The weights' dtype (`model.param_dtype`)."""
    return torch.bfloat16 if model_cfg.param_dtype == "bfloat16" else torch.float32


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
        self.module = module.to(device=self.device, dtype=param_dtype(model_cfg))
        self.tokenizer = tokenizer
        self.autocast_dtype = resolve_autocast(model_cfg.dtype, self.device)
        self.runner = torch.compile(self.module) if model_cfg.compile else self.module
        self.recompute = False  # gradient checkpointing on (see the module docstring)
        if self.backend == "gpt":
            self._ops = GPTOps
        else:
            from pipeline.model.hf import HFOps, fuse_activations, generation_eos_ids

            self._ops = HFOps
            fuse_activations(self.module)  # GPT-2's GELU as one op (a fast path: the formula under plain())
            self.tokenizer.add_eos_ids(generation_eos_ids(self.module))  # an instruct model's end-of-turn ids
        if model_cfg.gradient_checkpointing:
            self.enable_recompute()

    def enable_recompute(self) -> None:
        """Gradient checkpointing (hf backend): each layer recomputed in backward."""
        if self.backend != "hf":
            raise ValueError("model.gradient_checkpointing needs model.backend hf")
        from pipeline.model.hf import enable_gradient_checkpointing

        self.recompute = enable_gradient_checkpointing(self.module) > 0

    # ------------------------------------------------------------------ forward

    def set_compute_dtype(self, dtype: str) -> None:
        """The autocast dtype of this run (`model.dtype`), whatever the checkpoint was trained with:
        the compute dtype is a choice of the run, the weights keep their own dtype."""
        self.model_cfg = dataclasses.replace(self.model_cfg, dtype=dtype)
        self.autocast_dtype = resolve_autocast(dtype, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        """(B, T) token ids and 0/1 mask -> (B, T - logits_from, V) next-token logits.

        Under torch.compile the width is right-padded to a multiple of ``COMPILE_BUCKET`` columns
        (mask 0: causal attention never lets a pad change an earlier position) and `logits_from`
        rounded down to one, so rollouts of every length reuse a few compiled shapes instead of
        recompiling per width (the compiled graph guards on both)."""
        with self.autocast():
            if self.model_cfg.compile and self.runner is not self.module:
                return self._bucketed_logits(input_ids, attention_mask, logits_from)
            return self._ops.logits(self.runner, input_ids, attention_mask, logits_from)

    def _bucketed_logits(self, input_ids, attention_mask, logits_from: int) -> torch.Tensor:
        T, b = input_ids.shape[1], COMPILE_BUCKET
        width = -(-T // b) * b
        if self.max_len is not None and width > self.max_len:
            width = T
        ids = nn.functional.pad(input_ids, (0, width - T), value=self.tokenizer.pad_id)
        mask = nn.functional.pad(attention_mask, (0, width - T), value=0)
        start = logits_from // b * b
        out = self._ops.logits(self.runner, ids, mask, start)  # (B, width - start, V)
        return out[:, logits_from - start: T - start]

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                       *, start: int = 1, group_size: int = 1) -> torch.Tensor:
        """(N, T) log p(input_ids[:, t] | input_ids[:, :t]) at `temperature` for t >= `start`; 0 in
        the columns before `start` (column 0 always) and at pads. Differentiable when grad is enabled.

        `start`: the first wanted column (GRPO: the response start); the vocabulary projection and
        log-softmax of earlier columns are skipped, most of the (N, T, V) work when prompts are
        longer than responses. `group_size`: rows come in groups of that many whose first `start`
        columns agree (a rollout's layout; checked, other batches take the plain path); on the fast
        path each group's prompt then runs once and its responses on its keys/values, which every
        row of the group reads (same values and gradients; DDP and torch.compile take the plain path).
        Memory: the logits of the wanted columns in the model's dtype, (N, T - start, V) (two pieces on
        the fast path, never joined), and no log-softmax of them.
        """
        T = input_ids.shape[1]
        start = max(1, min(start, T))
        if not (fast.enabled() and self._shares_prompt(input_ids, attention_mask, start, group_size)):
            logits = self.logits(input_ids, attention_mask, logits_from=start - 1)[:, :-1]  # (N, T-start, V)
        else:
            with self.autocast():
                logits = self._ops.shared_prompt_logits(self.module, input_ids, attention_mask,
                                                        positions_from_mask(attention_mask), start, group_size)
        return gather_logprobs(logits, input_ids, attention_mask, temperature, start)

    def _shares_prompt(self, input_ids, attention_mask, start: int, group: int) -> bool:
        """The module runs directly (not DDP / compiled: those need one forward per backward), and
        rows come in groups whose first `start` columns agree."""
        N = input_ids.shape[0]
        if group <= 1 or start <= 1 or N % group or self.runner is not self.module:
            return False
        if self.recompute and torch.is_grad_enabled():  # a recomputed layer cannot replay the cache
            return False
        for t in (input_ids[:, :start], attention_mask[:, :start]):
            g = t.reshape(N // group, group, start)
            if not torch.equal(g, g[:, :1].expand_as(g)):
                return False
        return True

    def decoder(self, max_len: int):
        """A fresh KV-cached decoder for sequences of at most `max_len` positions."""
        return _Autocasting(self._ops.decoder(self.module, max_len, self.autocast_dtype), self)

    @property
    def max_len(self) -> int | None:
        """Longest context the model supports (positions), if it says."""
        return self._ops.max_len(self.module)

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a completion: end-of-text (hf: also the eos ids of the model's
        generation_config, an instruct model's end-of-turn tokens), and `</answer>` if it is one token."""
        ids = list(getattr(self.tokenizer, "eos_ids", [self.tokenizer.eos_id]))
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

    def no_sync(self):
        """DDP's ``no_sync`` (the next backward accumulates without an all-reduce) where the runner is
        DDP, also under a ``torch.compile`` wrapper of it; a null context where there is no DDP (a plain
        or compiled module, which has no ``no_sync``)."""
        ddp = getattr(self.runner, "_orig_mod", self.runner)  # torch.compile's OptimizedModule keeps it here
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return ddp.no_sync()
        return contextlib.nullcontext()

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

    def select(self, rows: torch.Tensor) -> bool:
        """Drop the rows not in `rows` from the decoder's cache where it can (see the decoders)."""
        select = getattr(self.inner, "select", None)
        return bool(select(rows)) if select is not None else False

    def step(self, tokens, positions) -> torch.Tensor:
        with self.policy.autocast():
            return self.inner.step(tokens, positions).float()


def build_policy(model_cfg: ModelConfig, tokenizer=None, device: str | torch.device | None = None) -> Policy:
    """A fresh policy from the config.

    `gpt`: a randomly initialised GPT sized by the config and `tokenizer.vocab_size` (to start from
    a saved checkpoint use :func:`pipeline.train.checkpoint.init_policy`). `hf`: the model and tokenizer
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

        module, hf_tok = load_hf(model_cfg.init, param_dtype(model_cfg))
        return Policy(module, hf_tok, model_cfg, device)
    raise ValueError(f"model.backend = {model_cfg.backend!r}; allowed: gpt, hf")
