"""log p(target) from logits, for the GRPO log-prob passes and SFT-style scoring.

``token_logprobs(logits, target)`` is ``log_softmax(logits)[target]``; on the fast path
(:mod:`pipeline.model.fastpaths`) it is ``logits[target] - logsumexp(logits)`` with one fused
backward. ``gather_logprobs`` lays the result out as the (N, T) per-token tensor of a rollout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model import fastpaths


class _TokenLogProb(torch.autograd.Function):
    """log_softmax(logits)[target] = logits[target] - logsumexp(logits), with one fused backward:
    d/dlogits = g * (onehot(target) - softmax(logits)), computed in place in one (M, V) buffer.
    Autograd's own graph for the same expression (gather, logsumexp, subtraction) makes about twice
    the passes over the (M, V) logits in backward; the values and gradients are the same (tests)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, lse, target)
        return logits.gather(-1, target[..., None]).squeeze(-1) - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, lse, target = ctx.saved_tensors
        out = (logits - lse[..., None]).exp_().mul_(-grad[..., None])  # -g * softmax
        out.scatter_add_(-1, target[..., None], grad[..., None])  # + g at the target
        return out, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log p(target) under logits (..., V) -> (...); differentiable (under no_grad / inference_mode
    no graph is recorded and nothing is kept)."""
    if not fastpaths.enabled():
        return logits.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    return _TokenLogProb.apply(logits, target)


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    temperature: float, start: int) -> torch.Tensor:
    """(N, T) log-probs of input_ids[:, start:] from the logits at positions start-1 .. T-2
    (N, T-start, V); columns before `start` and pads are 0."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    target = input_ids[:, start:]  # (N, T-start)
    logp = token_logprobs(logits, target)  # (N, T-start)
    logp = torch.where(attention_mask[:, start:].bool(), logp, torch.zeros_like(logp))
    return F.pad(logp, (start, 0))  # (N, T)
