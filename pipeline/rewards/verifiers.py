"""RLVR verifiers: pure functions `(completion, gold) -> float` (the reference chapter's section 1.3).

Correctness dominates (+1.0); a small format bonus (+0.2) rewards exactly one well-formed
`<answer>N</answer>` block; the most a completion earns is their sum, 1.2. The bonus stays small so a small model
cannot farm it: an empty or non-numeric tag earns nothing (the reward hack the reference chapter warns about).

Correct means: the answer the grammar of `pipeline.rewards.parsing` reads (its docstring has the rules:
where the answer is, what one number is, what is ambiguous) equals the gold exactly, both as exact
rationals. A float gold is read by its shortest repr (`72.0` -> 72, `0.1` -> 1/10), so `0.0001` is not
`0` and `2**53 + 1` is not `2**53`; there is no tolerance. The one allowance: a float gold cannot hold a
fraction whose decimals never end (1/3), so such a fraction matches the float nearest to it.
Well-formed means: one `<answer>` and one `</answer>`, in that order, around exactly one number of the
grammar and nothing else (`<answer>42</answer>`, `<answer>-3/4</answer>`; not `<answer>42 apples</answer>`).

A task's reward as a weighted sum of parts, other answer types and users' reward functions:
:mod:`pipeline.rewards.task_rewards` (the number tasks' `correct` and `format` parts are these checks).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any


from pipeline.rewards.parsing import (ANSWER_CLOSE, ANSWER_OPEN, answer_block, exact_number, extract_exact,
                                      is_single_number)

CORRECT_BONUS = 1.0
FORMAT_BONUS = 0.2


def _never_ends(x: Fraction) -> bool:
    """True if `x` has no finite decimal expansion (its denominator has a prime factor other than 2 and 5)."""
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d != 1


def _nearest(exact: Fraction, other: Any) -> bool:
    """True if `other` is a float and `exact` is a never-ending fraction whose nearest float it is."""
    return isinstance(other, float) and _never_ends(exact) and float(exact) == other


def answers_match(pred: Any, gold: Any) -> bool:
    """Exact equality of two answers (Fraction, int, float by its repr, or a string of one number).

    Non-finite or unreadable is no match; see the module docstring for the one float allowance.
    """
    p, g = exact_number(pred), exact_number(gold)
    if p is None or g is None:
        return False
    return p == g or _nearest(p, gold) or _nearest(g, pred)


def has_well_formed_answer(text: str) -> bool:
    """Exactly one `<answer>...</answer>` block whose content is a single number."""
    if not isinstance(text, str) or text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return False
    block = answer_block(text)
    return block is not None and is_single_number(block)


def reward_gsm8k(text: str, gold: float | None) -> float:
    """Correctness (dominant) + small format bonus; `gold=None` scores format only."""
    r = 0.0
    if answers_match(extract_exact(text), gold):
        r += CORRECT_BONUS
    if has_well_formed_answer(text):
        r += FORMAT_BONUS
    return r


def reward_arith(text: str, gold: float | None) -> float:
    """The curriculum's reward: the same parser and bonuses as GSM8K (answers are exact numbers)."""
    return reward_gsm8k(text, gold)


REWARDS = {"gsm8k": reward_gsm8k, "arith": reward_arith}


def reward_for(source: str):
    """The verifier for a row's `source` field."""
    try:
        return REWARDS[source]
    except KeyError:
        raise ValueError(f"no verifier for source {source!r}; known: {', '.join(REWARDS)}") from None
