"""Completions for evaluation, in fixed batches: greedy held-out accuracy during training
(`greedy_accuracy`, SFT and GRPO) and the evaluate stage's greedy and sampled completions
(`generate`). Both score nothing themselves beyond answer matching with the training verifier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.errors import InputError
from pipeline.rewards.parsing import extract_answer
from pipeline.rewards.verifiers import answers_match
from pipeline.rollout import rollout_prompts

EVAL_BATCH = 64  # prompts per greedy generation batch of `greedy_accuracy`


def greedy_correct_rows(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int) -> list[int]:
    """1 for each of `rows` whose greedy completion's `<answer>` matches the gold number, else 0; in order."""
    out: list[int] = []
    for s in range(0, len(rows), EVAL_BATCH):
        batch = rows[s:s + EVAL_BATCH]
        ro = rollout_prompts(policy, [r["prompt"] for r in batch], 1, max_new_tokens, greedy=True)
        out += [int(answers_match(extract_answer(t), r["gold"])) for t, r in zip(ro.texts, batch)]
    return out


def greedy_correct(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int) -> int:
    """How many of `rows` have a greedy completion whose `<answer>` matches the gold number."""
    return sum(greedy_correct_rows(policy, rows, max_new_tokens))


def greedy_accuracy(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int) -> float | None:
    """Fraction of `rows` whose greedy completion's `<answer>` matches the gold number."""
    return greedy_correct(policy, rows, max_new_tokens) / len(rows) if rows else None


def generate(policy, prompts: Sequence[str], *, batch_size: int, max_new_tokens: int, group_size: int = 1,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None,
             advance: Callable[[int], None] | None = None) -> tuple[list[str], list[int], list[bool]]:
    """Completions for `prompts`, `batch_size` prompts per KV-cached rollout; group-contiguous.

    Prompts are taken in the given order (deterministic batches). Where a batch's longest prompt
    plus `max_new_tokens` would overflow the model's context, that batch's budget shrinks to fit;
    the completions that hit the smaller budget count as truncated.
    """
    texts: list[str] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    limit = policy.max_len
    for start in range(0, len(prompts), batch_size):
        ids = [policy.tokenizer.encode(p) for p in prompts[start:start + batch_size]]
        budget = max_new_tokens
        if limit is not None:
            longest = max(len(x) for x in ids)
            budget = min(max_new_tokens, limit - longest)
            if budget < 1:
                raise InputError(f"a prompt of {longest} tokens leaves no room to answer in the model's "
                                 f"context of {limit} tokens (prompt #{start + 1}..{start + len(ids)})")
        ro = rollout_prompts(policy, None, group_size=group_size, max_new_tokens=budget,
                             temperature=temperature, top_p=top_p, top_k=0, greedy=greedy,
                             generator=generator, prompt_ids=ids)
        texts += list(ro.texts)
        lengths += [int(x) for x in ro.response_lengths.tolist()]
        truncated += [bool(x) for x in ro.truncated.tolist()]
        if advance is not None:
            advance(len(ids))
    return texts, lengths, truncated
