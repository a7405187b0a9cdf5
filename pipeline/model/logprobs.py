"""log p(target) from logits, for the GRPO log-prob passes and SFT-style scoring.

``token_logprobs(logits, target)`` is ``log_softmax(logits)[target]``; on the fast path
(:mod:`pipeline.model.fast`) it is ``logits[target] - logsumexp(logits)`` with one fused
backward. ``gather_logprobs`` lays the result out as the (N, T) per-token tensor of a rollout.

Memory: the logits stay in the dtype the model made them in (bf16 under autocast) and are
read in row chunks of at most ``CHUNK_ELEMENTS`` values, each cast to fp32 (and divided by the
temperature) only while its logsumexp, gather or gradient is taken. A (N, T, V) fp32 copy is
never made: with a 152k vocabulary that copy alone is 0.6 GB per 1,000 positions, twice the bf16
logits, and autograd kept it for backward (plus a same-sized gradient buffer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeline.model import fast


CHUNK_ELEMENTS = 1 << 25  # fp32 values cast at a time (128 MB): ~220 positions of a 152k vocabulary


def _chunks(rows: int, vocab: int, chunk_elements: int) -> list[slice]:
    step = max(1, chunk_elements // max(vocab, 1))
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


class _TokenLogProb(torch.autograd.Function):
    """log_softmax(logits / temperature)[target] = x[target] - logsumexp(x), x = logits / temperature
    in fp32, taken over row chunks (module docstring), with one fused backward per chunk:
    d/dlogits = g * (onehot(target) - softmax(x)) / temperature, in the logits' dtype.
    Autograd's own graph for the same expression (gather, logsumexp, subtraction) makes about twice
    the passes over the (M, V) logits in backward; the values and gradients are the same (tests)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk_elements: int):
        flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1, 1)  # (M, V), (M, 1)
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        lse = torch.empty(flat.shape[0], dtype=acc, device=flat.device)
        out = torch.empty_like(lse)
        for sl in _chunks(flat.shape[0], flat.shape[1], chunk_elements):
            x = flat[sl].to(acc) / temperature if temperature != 1.0 else flat[sl].to(acc)  # (m, V) fp32
            lse[sl] = torch.logsumexp(x, dim=-1)
            out[sl] = x.gather(-1, tgt[sl]).squeeze(-1) - lse[sl]
        ctx.save_for_backward(logits, lse, target)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        return out.view(target.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, lse, target = ctx.saved_tensors
        t = ctx.temperature
        flat, tgt, g = logits.reshape(-1, logits.shape[-1]), target.reshape(-1, 1), grad.reshape(-1, 1).to(lse.dtype)
        out = torch.empty_like(flat)
        in_place = out.dtype == lse.dtype  # fp32 logits: each chunk's gradient made in `out` itself
        for sl in _chunks(flat.shape[0], flat.shape[1], ctx.chunk_elements):
            x = flat[sl].to(lse.dtype) / t if t != 1.0 else flat[sl].to(lse.dtype)
            d = torch.sub(x, lse[sl, None], out=out[sl]) if in_place else x - lse[sl, None]
            d.exp_().mul_(-g[sl])  # -g * softmax
            d.scatter_add_(-1, tgt[sl], g[sl])  # + g at the target
            if not in_place:
                out[sl] = d / t if t != 1.0 else d
            elif t != 1.0:
                d.div_(t)
        return out.view(logits.shape), None, None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                   chunk_elements: int | None = None) -> torch.Tensor:
    """log p(target) under logits (..., V) / temperature -> (...) fp32; differentiable (under
    no_grad / inference_mode no graph is recorded and nothing is kept)."""
    if not fast.enabled():
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        x = x / temperature if temperature != 1.0 else x
        return x.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    return _TokenLogProb.apply(logits, target, float(temperature), chunk_elements or CHUNK_ELEMENTS)


def gather_logprobs(logits: torch.Tensor | Sequence[torch.Tensor], input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, temperature: float, start: int) -> torch.Tensor:
    """(N, T) log-probs of input_ids[:, start:] from the logits at positions start-1 .. T-2:
    (N, T-start, V), or a sequence of pieces that cover those columns in order (the shared-prompt
    passes: the prompt's last position, then the response columns; taken piece by piece, so the
    pieces are never copied into one (N, T-start, V) tensor, nor its gradient split back out; on CPU
    the same bits as the joined tensor); columns before `start` and pads are 0."""
    target = input_ids[:, start:]  # (N, T-start)
    if isinstance(logits, torch.Tensor):
        logp = token_logprobs(logits, target, temperature)  # (N, T-start) fp32
    else:
        widths = [piece.shape[1] for piece in logits]
        if sum(widths) != target.shape[1]:
            raise ValueError(f"logit pieces cover {sum(widths)} columns, not {target.shape[1]}")
        parts = [token_logprobs(piece, cols, temperature)
                 for piece, cols in zip(logits, target.split(widths, dim=1))]
        logp = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    logp = torch.where(attention_mask[:, start:].bool(), logp, torch.zeros_like(logp))
    return F.pad(logp, (start, 0))  # (N, T)
