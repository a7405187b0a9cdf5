"""The GRPO update: log-probs of a rolled-out batch and the optimizer steps on the clipped surrogate.

``old_and_ref_logprobs`` gives the behaviour and reference log-probs (under no grad); ``update`` runs
``grpo_epochs`` passes over minibatches of whole groups, each in micro-batches of ``micro_batch_size``
rows whose gradients add up to those of one pass (``accumulate_gradients``), the loss from
:mod:`pipeline.rl.loss`. Plain arguments only (the policy, its reference, the stage's config section,
a :class:`Batch`), so a benchmark or a test drives the update without a stage around it; the stage
(``pipeline.stages.grpo``) supplies the optimizer step that skips and counts non-finite ones.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.core import distributed as dist_utils
from pipeline.core.config import GRPOConfig
from pipeline.model import fast
from pipeline.model.policy import Policy
from pipeline.rl.loss import grpo_loss, loss_units


@dataclass
class Batch:
    """The tensors of one update: (N, T) ids and masks, (N,) advantages, (N, T) old/ref log-probs
    (old None: the policy has not moved since sampling), `start` the first response column."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    start: int = 1


def micro_batches(rows: slice, size: int) -> list[slice]:
    """`rows` cut into slices of `size` rows (0: one slice)."""
    size = size or rows.stop - rows.start
    return [slice(s, min(s + size, rows.stop)) for s in range(rows.start, rows.stop, size)]


def own_width(attention_mask: torch.Tensor) -> int:
    """Columns up to the last one any row of `attention_mask` (n, T) attends: a rollout pads every
    row to the batch's longest response, so a micro-batch of shorter rows ends in columns that are
    pads in all of its rows."""
    cols = attention_mask.any(0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else attention_mask.shape[1]


def micro_logprobs(model: Policy, ids: torch.Tensor, attn: torch.Tensor, temperature: float, start: int,
                   group: int) -> torch.Tensor:
    """`model.token_logprobs` of one micro-batch over its own width (:func:`own_width`), padded back to
    (n, T) with zeros. Causal attention: no kept column reads a dropped one, so the kept columns' log-
    probs and gradients are those of the full-width pass; the dropped columns are pads, 0 there too.
    With a rollout's lengths (a few rows run to `rollout_len`, most stop far sooner) most micro-batches
    are much narrower than the batch."""
    T = ids.shape[1]
    width = max(own_width(attn), min(start + 1, T))
    logp = model.token_logprobs(ids[:, :width], attn[:, :width], temperature, start=start, group_size=group)
    return torch.nn.functional.pad(logp, (0, T - width)) if width < T else logp


def old_and_ref_logprobs(policy: Policy, ref: Any, conf: GRPOConfig, ids: torch.Tensor, attn: torch.Tensor,
                         start: int, sampled: torch.Tensor | None = None, sharded: bool = False):
    """(old, ref) per-token log-probs under inference mode, `micro_batch_size` rows per pass;
    either may be None (see `Batch`).

    old: None with one optimizer step per iteration (the policy has not moved since sampling, so
    old = new.detach() exactly; TRL does the same). Otherwise the log-probs the rollout recorded while
    sampling (`sampled`, PPO's behaviour log-probs: the same weights, temperature and full-vocabulary
    distribution as a recomputed pass, to fp32 rounding) where :func:`reuses_sampled_logprobs` says
    they are that, else one more forward pass of the policy under no grad. `ref`: anything with
    `token_logprobs` (a frozen policy, the policy with its adapters off) or None (no KL term);
    `sharded`: the policy is FSDP-sharded, whose passes reuse gathered-weight buffers."""
    single_step = conf.grpo_epochs == 1 and conf.minibatch_groups in (0, conf.prompts_per_iter)
    group = math.gcd(conf.micro_batch_size, conf.group_size) if conf.micro_batch_size else conf.group_size
    parts = micro_batches(slice(0, ids.shape[0]), conf.micro_batch_size)

    def passes(model) -> torch.Tensor:
        return torch.cat([micro_logprobs(model, ids[sl], attn[sl], conf.temperature, start, group) for sl in parts])

    # a sharded module's passes reuse its gathered-weight buffers in training: no inference tensors there
    with torch.no_grad() if sharded else torch.inference_mode():
        if single_step:
            old = None
        elif sampled is not None and reuses_sampled_logprobs(policy):
            old = sampled
        else:
            old = passes(policy)
        ref_lp = passes(ref) if ref else None
    return old, ref_lp


def reuses_sampled_logprobs(policy: Policy) -> bool:
    """Whether the rollout's recorded log-probs stand in for a recomputed old pass (a fast path,
    `pipeline.model.fast`): compute and weights in fp32, where the decode path and the training
    forward agree to ~1e-6 (tests/test_old_logprobs.py). Under bf16 (autocast or bf16 weights) the two
    paths round differently by ~1e-2, enough to move the clipped ratio, so the old pass is recomputed
    with the training forward, as verl and TRL do for their rollout engines."""
    return (fast.enabled() and policy.autocast_dtype is None
            and all(p.dtype == torch.float32 for p in policy.module.parameters()))


def accumulate_gradients(policy: Policy, conf: GRPOConfig, batch: Batch, rows: slice):
    """Forward + backward of the minibatch `rows` in micro-batches of `conf.micro_batch_size` rows.
    Each micro-batch's loss is weighted by its share of the minibatch's normaliser (`loss_units`),
    and, under DDP, each rank's by its share of the global one, so the accumulated gradient is that
    of one pass over the whole minibatch on one process. Returns (loss, statistics), weighted alike.
    A micro-batch whose size divides, or is divided by, G keeps the shared-prompt log-prob path
    (rows in sub-groups of gcd(size, G) still share their prompt)."""
    resp = batch.response_mask[rows]
    total = max(loss_units(resp, conf.loss_agg), 1.0)
    ddp = dist_utils.loss_weight(loss_units(resp, conf.loss_agg))
    group = math.gcd(conf.micro_batch_size, conf.group_size) if conf.micro_batch_size else conf.group_size
    parts = micro_batches(rows, conf.micro_batch_size)
    loss_sum, stats = torch.zeros((), device=policy.device), {}
    for i, sl in enumerate(parts):
        last = i == len(parts) - 1
        # DDP all-reduces once, on the last micro-batch: forward and backward both inside `no_sync`
        # (DDP decides at the forward whether the next backward reduces)
        with contextlib.nullcontext() if last else policy.no_sync():
            new_lp = micro_logprobs(policy, batch.input_ids[sl], batch.attention_mask[sl], conf.temperature,
                                    batch.start, group)
            old = new_lp.detach() if batch.old_logprobs is None else batch.old_logprobs[sl]
            ref = batch.ref_logprobs[sl] if batch.ref_logprobs is not None else None
            loss, st = grpo_loss(new_lp, old, ref, batch.advantages[sl], batch.response_mask[sl], clip=conf.clip,
                                 kl_coef=conf.kl_coef, clip_high=conf.clip_high or None, loss_agg=conf.loss_agg,
                                 importance=conf.importance, max_len=conf.rollout_len)
            w = loss_units(batch.response_mask[sl], conf.loss_agg) / total
            (loss * (w * ddp)).backward()
        loss_sum = loss_sum + loss.detach() * (w * ddp)
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v * w
    return loss_sum, stats


def update(policy: Policy, optimizer: torch.optim.Optimizer, conf: GRPOConfig, batch: Batch,
           step: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[str, float]:
    """`grpo_epochs` passes over minibatches of whole groups (each in micro-batches, one optimizer
    step per minibatch). `step(loss)` clips and takes the optimizer step after the minibatch's
    gradients are in and returns the gradient norm, or None where it skipped a non-finite step (the
    stage's: pipeline.train.optim counts them). Returns the mean of each loss statistic over the steps
    taken.

    `minibatch_groups` counts groups over all processes: under DDP each of the `world` processes
    puts `minibatch_groups / world` of its own groups into each step, so every process count takes
    the same number of optimizer steps, each over `minibatch_groups` groups."""
    G, n = conf.group_size, batch.input_ids.shape[0]
    mb = (conf.minibatch_groups // dist_utils.world_size() or n // G) * G
    acc: dict[str, list[torch.Tensor]] = {}
    for _ in range(conf.grpo_epochs):
        for s in range(0, n, mb):
            optimizer.zero_grad(set_to_none=True)
            loss, st = accumulate_gradients(policy, conf, batch, slice(s, min(s + mb, n)))
            norm = step(loss)
            if norm is not None:
                for k, v in {**st, "loss": loss, "grad_norm": norm}.items():
                    acc.setdefault(k, []).append(v)
    if not acc:
        return {"kl": float("nan"), "clipfrac": float("nan"), "loss": float("nan"), "grad_norm": float("nan")}
    return {k: sum(float(x) for x in v) / len(v) for k, v in acc.items()}  # host syncs here, once per value
