"""The attention mask the transformers backend gives a model for a forward whose keys are its own
positions: :func:`self_attending_mask`, in which a left pad's query sees itself, so no attention row
is empty (see there). ``pipeline.model.hf`` passes it in the policy's full forward and in the
prompt prefills into an empty cache.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


def _unwrapped(runner) -> nn.Module:
    """The module under torch.compile's and DDP's wrappers."""
    while True:
        inner = getattr(runner, "_orig_mod", None)
        if inner is None and isinstance(runner, nn.parallel.DistributedDataParallel):
            inner = runner.module
        if inner is None:
            return runner
        runner = inner


_SELF_MASK_TYPES = ("llama", "gpt2", "qwen2")  # SDPA masks checked in tests/test_hf_mask.py
_warned_2d_mask: list[bool] = []


def self_attending_mask(model: nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """The attention mask to give `model` for a forward of (B, T) rows and their 0/1 `attention_mask`
    whose keys are those T positions (a full forward, or a prompt prefill into an empty DynamicCache):
    with left padding, a (B, 1, T, T) boolean mask (True = attend) in which every query sees the real
    keys at or before it AND itself; else `attention_mask` unchanged.

    Why: from a 2-D mask transformers builds the causal-and-padding mask, in which a left pad's query
    sees no key at all. Its attention row is then entirely masked, and what comes out of it is up to
    the kernel: eager SDPA returns zeros there, but a softmax over a row of -inf is 0/0, and a NaN at
    a pad position reaches the real positions through the next layer (a weight of 0 times a NaN value
    is NaN). With each query also seeing itself no row is empty, and nothing else changes: a real
    query sees itself anyway, and no real query sees a pad. Only for SDPA attention of the plain
    causal self-attention models whose masks are checked in the tests (``_SELF_MASK_TYPES``: Llama,
    GPT-2, Qwen2 with every layer full attention): other attention functions want other mask
    formats, and sliding-window or hybrid layers build masks of their own. A compiled forward of
    any other model keeps the 2-D mask, with a warning (once) where its rows are left-padded."""
    compiled = getattr(model, "_orig_mod", None) is not None
    if not compiled and bool(attention_mask[:, 0].all()):  # no left padding: every query has its own key
        return attention_mask  # (a compiled forward always gets the 4-D mask: one mask dtype, one graph)
    cfg = getattr(_unwrapped(model), "config", None)
    if (cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa"
            or getattr(cfg, "model_type", None) not in _SELF_MASK_TYPES
            or getattr(cfg, "use_sliding_window", False)
            or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ()))):
        if compiled and not _warned_2d_mask and not bool(attention_mask[:, 0].all()):
            _warned_2d_mask.append(True)
            log.warning("model.compile: %s with %s attention gets transformers' own mask, in which a left pad's "
                        "query sees no key; if its updates come out non-finite, set model.compile=false",
                        getattr(cfg, "model_type", type(model).__name__),
                        getattr(cfg, "_attn_implementation", "its"))
        return attention_mask
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    seen = causal & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T): real keys at or before the query
    return seen | torch.eye(T, dtype=torch.bool, device=attention_mask.device)
