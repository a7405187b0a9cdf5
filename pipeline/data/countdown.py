"""Seeded Countdown problems: reach a target with given numbers, each used once, with + - * / and ().

A problem is built backwards so that it is always solvable: `n_numbers` numbers are drawn from
1..max_number, then combined in a random order, one at a time, each with a random operator from
`+ - *` (and `/` only where it divides exactly) on a random side of the expression so far; the value
is the target and the expression is kept as the problem's `solution` (e.g. `(3 + 5) * 2`). A target
outside 1..MAX_TARGET is drawn again. The answer is checked by `pipeline.rewards.countdown`.

The held-out set is drawn first, its (numbers as a multiset, target) pairs distinct; the training
stream then skips those pairs (and may repeat its own), so no held-out problem is seen in training,
even with its numbers in another order. One random stream (`countdown-{seed}`): the same arguments give the same lists.
"""

from __future__ import annotations

import random
from typing import Any

MAX_TARGET = 1000
ATTEMPTS_PER_PROBLEM = 1000  # draws allowed per wanted problem before the settings are called too narrow

Key = tuple[tuple[int, ...], int]  # (sorted numbers, target): what makes two problems the same


def generate_countdown(train_size: int, eval_size: int, seed: int, n_numbers: int = 3,
                       max_number: int = 20) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training problems, held-out problems): seeded, solvable, disjoint by numbers and target."""
    if train_size < 1 or eval_size < 1:
        raise ValueError(f"countdown: train_size and eval_size must be >= 1, got {train_size} and {eval_size}")
    if not 2 <= n_numbers <= 6:
        raise ValueError(f"countdown: n_numbers must be in 2..6, got {n_numbers}")
    if max_number < 1:
        raise ValueError(f"countdown: max_number must be >= 1, got {max_number}")
    rng = random.Random(f"countdown-{seed}")
    held_out = _draw(eval_size, set(), rng, n_numbers, max_number, distinct=True)
    train = _draw(train_size, {_key(p) for p in held_out}, rng, n_numbers, max_number, distinct=False)
    return train, held_out


def _draw(size: int, taken: set[Key], rng: random.Random, n_numbers: int, max_number: int,
          distinct: bool) -> list[dict[str, Any]]:
    """`size` problems whose keys are not in `taken`; with `distinct`, none twice either."""
    problems: list[dict[str, Any]] = []
    for _ in range(size * ATTEMPTS_PER_PROBLEM):
        problem = _problem(len(problems), rng, n_numbers, max_number)
        if problem is not None and _key(problem) not in taken:
            if distinct:
                taken.add(_key(problem))
            problems.append(problem)
            if len(problems) == size:
                return problems
    raise ValueError(f"countdown: found only {len(problems)} of {size} new problems with "
                     f"n_numbers={n_numbers}, max_number={max_number}; ask for fewer or widen them")


def _problem(index: int, rng: random.Random, n_numbers: int, max_number: int) -> dict[str, Any] | None:
    """One random problem, or None if its target fell outside 1..MAX_TARGET."""
    numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
    solution, target = _combine(rng.sample(numbers, len(numbers)), rng)
    if not 1 <= target <= MAX_TARGET:
        return None
    question = f"Using the numbers {numbers} each exactly once, with + - * / and parentheses, make {target}."
    return {"id": f"countdown-{index}", "question": question, "numbers": numbers, "target": target,
            "solution": solution}


def _combine(order: list[int], rng: random.Random) -> tuple[str, int]:
    """An expression using each of `order` once, in that order, with random operators; and its value."""
    text, value = str(order[0]), order[0]
    for number in order[1:]:
        wrapped = f"({text})" if " " in text else text  # a lone number needs no parentheses
        left, right = (wrapped, value), (str(number), number)
        if rng.random() < 0.5:  # the new number on either side, so `-` and `/` vary in both directions
            left, right = right, left
        op = rng.choice(_operators(left[1], right[1]))
        text, value = f"{left[0]} {op} {right[0]}", _apply(left[1], op, right[1])
    return text, value


def _operators(left: int, right: int) -> tuple[str, ...]:
    """The operators allowed between `left` and `right`: `/` only where it leaves no remainder."""
    return ("+", "-", "*", "/") if right != 0 and left % right == 0 else ("+", "-", "*")


def _apply(left: int, op: str, right: int) -> int:
    """`left op right` for integers (`/` only where exact)."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left // right


def _key(problem: dict[str, Any]) -> Key:
    """The problem's numbers as a multiset and its target."""
    return tuple(sorted(problem["numbers"])), problem["target"]
