"""Completions for evaluation, in fixed batches: greedy held-out accuracy during training
(`greedy_accuracy`, SFT and GRPO) and the evaluate stage's greedy and sampled completions
(`generate`). Both score nothing themselves beyond answer matching with the training verifier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.core.errors import InputError
from pipeline.rewards.parsing import extract_answer
from pipeline.rewards.verifiers import answers_match
from pipeline.rl.rollout import rollout_prompts

EVAL_BATCH = 64  # prompts per greedy generation batch of `greedy_accuracy`


Correct = Callable[[str, dict[str, Any]], bool]  # (completion, row) -> whether it answers the row


def number_correct(text: str, row: dict[str, Any]) -> bool:
    """The number task's check (gsm8k, arith): the parsed answer equals the gold number."""
    return bool(answers_match(extract_answer(text), row["gold"]))


def greedy_correct_rows(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                        correct: Correct = number_correct) -> list[int]:
    """1 for each of `rows` whose greedy completion is `correct` (default: the gold number), else 0; in order."""
    out: list[int] = []
    for s in range(0, len(rows), EVAL_BATCH):
        batch = rows[s:s + EVAL_BATCH]
        ro = rollout_prompts(policy, [r["prompt"] for r in batch], 1, max_new_tokens, greedy=True)
        out += [int(correct(t, r)) for t, r in zip(ro.texts, batch)]
    return out


def greedy_correct(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                   correct: Correct = number_correct) -> int:
    """How many of `rows` have a correct greedy completion."""
    return sum(greedy_correct_rows(policy, rows, max_new_tokens, correct))


def greedy_accuracy(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                    correct: Correct = number_correct) -> float | None:
    """Fraction of `rows` whose greedy completion is correct (None: no rows)."""
    return greedy_correct(policy, rows, max_new_tokens, correct) / len(rows) if rows else None


def row_budgets(policy, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[int]:
    """Each prompt's own budget of new tokens: `max_new_tokens`, or what the model's context leaves
    after that prompt (0: it cannot be answered at all). It depends on the row alone, never on the
    batch it is generated in."""
    limit = policy.max_len
    return [max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - len(x))) for x in prompt_ids]


def generate(policy, prompts: Sequence[str], *, batch_size: int, max_new_tokens: int, group_size: int = 1,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
             generator: torch.Generator | None = None,
             advance: Callable[[int], None] | None = None) -> tuple[list[str], list[int], list[bool]]:
    """Completions for `prompts`, `batch_size` prompts per KV-cached rollout; group-contiguous.

    Every row gets its own budget (:func:`row_budgets`), whatever the batch: the rows that have the
    whole `max_new_tokens` are generated in batches in the given order (deterministic batches); a
    row whose prompt leaves less room in the model's context is generated on its own with what is
    left (its completion counts as truncated if it hits that smaller budget). A row with no room at
    all is refused (InputError naming it): callers set such rows aside first (the evaluate stage
    reports them by id and scores the rest).
    """
    ids = [policy.tokenizer.encode(p) for p in prompts]
    budgets = row_budgets(policy, ids, max_new_tokens)
    for i, b in enumerate(budgets):
        if b < 1:
            raise InputError(f"prompt #{i + 1} has {len(ids[i])} tokens: no room to answer in the model's context "
                             f"of {policy.max_len} tokens")
    full = [i for i, b in enumerate(budgets) if b == max_new_tokens]
    batches = [(full[s:s + batch_size], max_new_tokens) for s in range(0, len(full), batch_size)]
    batches += [([i], b) for i, b in enumerate(budgets) if b != max_new_tokens]
    out: dict[int, tuple[list[str], list[int], list[bool]]] = {}
    for rows, budget in batches:
        ro = rollout_prompts(policy, None, group_size=group_size, max_new_tokens=budget,
                             temperature=temperature, top_p=top_p, top_k=0, greedy=greedy,
                             generator=generator, prompt_ids=[ids[i] for i in rows])
        lengths, truncated = ro.response_lengths.tolist(), ro.truncated.tolist()
        for j, i in enumerate(rows):  # group-contiguous: row j's completions are j*G .. (j+1)*G-1
            span = slice(j * group_size, (j + 1) * group_size)
            out[i] = (list(ro.texts[span]), [int(x) for x in lengths[span]], [bool(x) for x in truncated[span]])
        if advance is not None:
            advance(len(rows))
    texts = [t for i in range(len(prompts)) for t in out[i][0]]
    lengths = [n for i in range(len(prompts)) for n in out[i][1]]
    return texts, lengths, [t for i in range(len(prompts)) for t in out[i][2]]
