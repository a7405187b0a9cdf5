"""Seeded arithmetic curriculum: short problems whose answers are computed exactly with Python ints.

Levels (by digits and operations):
  1  one-digit + and -                       7 + 5, 9 - 3
  2  two-digit + and -                       47 + 38, 83 - 29
  3  two-digit * one-digit, two-digit +/-    34 * 7, 56 + 17
  4  two steps, small numbers                3 + 4 * 5, (12 - 5) + 9, (3 + 4) * 6, 7 * 8 - 13
  5  three-digit: +/-, * one-digit, two steps 482 + 369, 517 * 6, 340 + 12 * 7
Results are never negative. Multiplication is written `*`, as in GSM8K's worked solutions.

A problem's question is one of a few phrasings of its expression; its solution is worked lines then
`<answer>N</answer>`, the same shape as a rewritten GSM8K solution. Two solution formats:
  lines   one line per operation                      47 + 38 = 85.
  digits  column by column, units first, then the     7 + 8 = 15.  4 + 3 + 1 = 8.  47 + 38 = 85.
          whole operation (the default)
With `digits` every multi-digit problem is made of the same few one-digit facts (with carries and
borrows written out), so what a model learns on one problem carries over to unseen ones; with `lines`
a two-digit sum is one opaque step. The held-out set
has distinct expressions, none of which appear in the training stream (disjoint by expression, so a
rephrasing does not leak). Both sets have every level equally often (levels round-robin, shuffled).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import InputError
from pipeline.data.prompts import format_answer, format_prompt

MAX_LEVEL = 5
PHRASINGS = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "Find the value of {e}.")


@dataclass(frozen=True)
class Problem:
    level: int
    expr: str  # the expression as shown in the question, e.g. "3 + 4 * 5"
    answer: int
    ops: tuple[tuple[int, str, int], ...]  # the operations in order, e.g. ((4, "*", 5), (3, "+", 20))

    @property
    def steps(self) -> tuple[str, ...]:
        """One worked line per operation, e.g. ("4 * 5 = 20", "3 + 20 = 23")."""
        return tuple("{} = {}".format(*_binary(a, op, b)) for a, op, b in self.ops)


def _binary(a: int, op: str, b: int) -> tuple[str, int]:
    """`a op b` as text and its exact value."""
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b}", value


def _columns_add(a: int, b: int) -> list[str]:
    """Column lines of `a + b`, units first: "7 + 8 = 15", then "4 + 3 + 1 = 8" with the carry."""
    lines, carry, i = [], 0, 0
    da, db = str(a)[::-1], str(b)[::-1]
    while i < max(len(da), len(db)) or carry:
        terms = [int(s[i]) for s in (da, db) if i < len(s)] + ([carry] if carry else [])
        total = sum(terms)
        if len(terms) > 1:  # a lone digit is copied as is, no line
            lines.append(" + ".join(map(str, terms)) + f" = {total}")
        carry, i = total // 10, i + 1
    return lines


def _columns_sub(a: int, b: int) -> list[str]:
    """Column lines of `a - b` (a >= b), units first, borrowing: "13 - 9 = 4", then "8 - 1 - 2 = 5"."""
    lines, borrow = [], 0
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(len(da)):
        x, y = int(da[i]), int(db[i]) if i < len(db) else None
        if y is None and not borrow:
            continue  # copied as is
        need = 1 if x - borrow - (y or 0) < 0 else 0
        terms = [x + 10 * need] + ([borrow] if borrow else []) + ([y] if y is not None else [])
        lines.append(" - ".join(map(str, terms)) + f" = {terms[0] - sum(terms[1:])}")
        borrow = need
    return lines


def _columns_mul(a: int, b: int) -> list[str]:
    """Column lines of `a * b` with one-digit b, units first: "4 * 7 = 28", then "3 * 7 + 2 = 23"."""
    lines, carry = [], 0
    for ch in str(a)[::-1]:
        product = int(ch) * b + carry
        lines.append(f"{ch} * {b}" + (f" + {carry}" if carry else "") + f" = {product}")
        carry = product // 10
    return lines


def worked_lines(a: int, op: str, b: int) -> list[str]:
    """The lines of one operation in the `digits` format: its column steps then the whole equation."""
    expr, value = _binary(a, op, b)
    if a < 10 and b < 10:
        return [f"{expr} = {value}"]  # a one-digit fact is its own step
    if op == "+":
        cols = _columns_add(a, b)
    elif op == "-":
        cols = _columns_sub(a, b)
    elif b < 10:
        cols = _columns_mul(a, b)
    elif a < 10:
        cols = _columns_mul(b, a)
    else:
        cols = []  # a long multiplication is not broken down
    return [*cols, f"{expr} = {value}"]


def _one_step(level: int, a: int, op: str, b: int) -> Problem:
    if op == "-" and b > a:
        a, b = b, a
    expr, value = _binary(a, op, b)
    return Problem(level, expr, value, ((a, op, b),))


def _two_step(level: int, rng: random.Random, lo: int, hi: int) -> Problem:
    """One of four two-operation shapes; operands of the first step in [lo, hi]."""
    shape = rng.randrange(4)
    a, b, c = rng.randint(lo, hi), rng.randint(2, 9), rng.randint(2, 9)
    if shape == 0:  # a + b * c
        inner, v = _binary(b, "*", c)
        _, ans = _binary(a, "+", v)
        return Problem(level, f"{a} + {inner}", ans, ((b, "*", c), (a, "+", v)))
    if shape == 1:  # (a - b) + c
        b = rng.randint(1, a)
        c = rng.randint(lo, hi)
        inner, v = _binary(a, "-", b)
        _, ans = _binary(v, "+", c)
        return Problem(level, f"({inner}) + {c}", ans, ((a, "-", b), (v, "+", c)))
    if shape == 2:  # (a + b) * c, with a small enough to keep the product modest
        a = rng.randint(lo, max(lo, hi // 2))
        inner, v = _binary(a, "+", b)
        _, ans = _binary(v, "*", c)
        return Problem(level, f"({inner}) * {c}", ans, ((a, "+", b), (v, "*", c)))
    # a * b - c with 0 <= c <= a * b
    a = rng.randint(2, 9) if hi < 100 else rng.randint(lo, hi)
    inner, v = _binary(a, "*", b)
    c = rng.randint(0, v)
    _, ans = _binary(v, "-", c)
    return Problem(level, f"{inner} - {c}", ans, ((a, "*", b), (v, "-", c)))


def _level1(rng: random.Random) -> Problem:
    return _one_step(1, rng.randint(0, 9), rng.choice("+-"), rng.randint(0, 9))


def _level2(rng: random.Random) -> Problem:
    return _one_step(2, rng.randint(10, 99), rng.choice("+-"), rng.randint(10, 99))


def _level3(rng: random.Random) -> Problem:
    op = rng.choice("+-*")
    if op == "*":
        return _one_step(3, rng.randint(10, 99), "*", rng.randint(2, 9))
    return _one_step(3, rng.randint(10, 99), op, rng.randint(1, 99))


def _level4(rng: random.Random) -> Problem:
    return _two_step(4, rng, 1, 20)


def _level5(rng: random.Random) -> Problem:
    kind = rng.randrange(3)
    if kind == 0:
        return _one_step(5, rng.randint(100, 999), rng.choice("+-"), rng.randint(100, 999))
    if kind == 1:
        return _one_step(5, rng.randint(100, 999), "*", rng.randint(2, 9))
    return _two_step(5, rng, 100, 999)


GENERATORS: dict[int, Callable[[random.Random], Problem]] = {
    1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def sample_problem(level: int, rng: random.Random) -> Problem:
    if level not in GENERATORS:
        raise ValueError(f"arithmetic level {level} is not in 1..{MAX_LEVEL}")
    return GENERATORS[level](rng)


SOLUTION_STYLES = ("digits", "lines")


def solution_text(p: Problem, style: str = "digits") -> str:
    """Worked lines then the tagged answer, e.g. "4 * 5 = 20.\\n3 + 20 = 23.\\n<answer>23</answer>" (lines)."""
    if style == "lines":
        steps = list(p.steps)
    elif style == "digits":
        steps = [line for a, op, b in p.ops for line in worked_lines(a, op, b)]
    else:
        raise ValueError(f"arithmetic solution style {style!r} is not one of {SOLUTION_STYLES}")
    return "".join(f"{s}.\n" for s in steps) + format_answer(p.answer)


def to_row(p: Problem, row_id: str, rng: random.Random, template: str, style: str = "digits") -> dict[str, Any]:
    question = rng.choice(PHRASINGS).format(e=p.expr)
    return {"id": row_id, "source": "arith", "question": question, "prompt": format_prompt(question, template),
            "gold": float(p.answer), "solution": solution_text(p, style), "level": p.level}


def _levels(n: int, max_level: int, rng: random.Random) -> list[int]:
    levels = [1 + i % max_level for i in range(n)]
    rng.shuffle(levels)
    return levels


def generate_curriculum(train_size: int, eval_size: int, max_level: int, seed: int,
                        template: str, style: str = "digits") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training stream, held-out set): seeded, every level equally often, disjoint by expression."""
    if not 1 <= max_level <= MAX_LEVEL:
        raise ValueError(f"max_level must be in 1..{MAX_LEVEL}, got {max_level}")
    rng_eval, rng_train = random.Random(f"arith-eval-{seed}"), random.Random(f"arith-train-{seed}")
    held_out: set[str] = set()
    eval_rows = []
    for i, level in enumerate(_levels(eval_size, max_level, rng_eval)):
        for _ in range(10_000):  # distinct expressions; small levels have few (level 1: 155)
            p = sample_problem(level, rng_eval)
            if p.expr not in held_out:
                break
        else:
            raise InputError(f"data.arith_eval_size = {eval_size} is too large: level {level} has too few "
                             f"distinct problems for {eval_size // max_level + 1} held-out ones")
        held_out.add(p.expr)
        eval_rows.append(to_row(p, f"arith-eval-{i:05d}", rng_eval, template, style))
    train_rows = []
    for i, level in enumerate(_levels(train_size, max_level, rng_train)):
        for _ in range(10_000):
            p = sample_problem(level, rng_train)
            if p.expr not in held_out:
                break
        else:
            raise InputError(f"data.arith_eval_size = {eval_size} leaves no level-{level} problems for training")
        train_rows.append(to_row(p, f"arith-train-{i:06d}", rng_train, template, style))
    return train_rows, eval_rows
