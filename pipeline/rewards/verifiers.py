"""RLVR verifiers: pure functions `(completion, gold) -> float` (the seed's section 1.3).

Correctness dominates (+1.0); a small format bonus (+0.2) rewards exactly one well-formed
`<answer>N</answer>` block; the sum is clipped at 1.2. The bonus stays small so a small model
cannot farm it: an empty or non-numeric tag earns nothing (the reward hack the seed warns about).
"""

from __future__ import annotations

import math

from pipeline.rewards.parsing import ANSWER_CLOSE, ANSWER_OPEN, answer_block, extract_answer, is_single_number, parse_gold

CORRECT_BONUS = 1.0
FORMAT_BONUS = 0.2
REWARD_CLIP = 1.2
ABS_TOL = 1e-4


def answers_match(pred: float | None, gold: float | str | None) -> bool:
    """Within ABS_TOL; a string gold is read by the answer grammar, non-finite or unreadable is no match."""
    pred, gold = parse_gold(pred), parse_gold(gold)
    return pred is not None and gold is not None and math.isclose(pred, gold, rel_tol=0.0, abs_tol=ABS_TOL)


def has_well_formed_answer(text: str) -> bool:
    """Exactly one `<answer>...</answer>` block whose content is a single number."""
    if not isinstance(text, str) or text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return False
    block = answer_block(text)
    return block is not None and is_single_number(block)


def reward_gsm8k(text: str, gold: float | None) -> float:
    """Correctness (dominant) + small format bonus, clipped; `gold=None` scores format only."""
    r = 0.0
    if answers_match(extract_answer(text), gold):
        r += CORRECT_BONUS
    if has_well_formed_answer(text):
        r += FORMAT_BONUS
    return min(r, REWARD_CLIP)


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
