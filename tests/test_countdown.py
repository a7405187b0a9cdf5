"""The Countdown task: the verifier of pipeline/rewards/countdown.py (hand cases, exact evaluation of
random expression trees, no crash on random text) and the generator of pipeline/data/countdown.py
(seeded, every problem solvable by its own solution, held-out pairs never in training)."""

from __future__ import annotations

import operator
import os
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.data.countdown import generate_countdown
from pipeline.rewards.countdown import MAX_DEPTH, check_countdown, evaluate, numbers_used, parse_expression

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
# (answer text, target, numbers, expected)
HAND_CASES = [
    ("(6+4)*2", 20, [6, 4, 2], True),
    ("6+4*2", 14, [6, 4, 2], True),
    ("(6+4)*2 = 20", 20, [6, 4, 2], True),
    ("((6))+(4)*(\n2)", 14, [6, 4, 2], True),
    ("  (6 + 4) × 2  ", 20, [6, 4, 2], True),
    ("(6+4)÷2*4", 20, [6, 4, 2, 4], True),
    ("7/2*2", 7, [7, 2, 2], True),  # exact: 7/2 is not rounded
    ("6*4", 24, [6, 4, 2], False),  # 2 unused
    ("6+6+4+2", 18, [6, 4, 2], False),  # 6 reused
    ("(6+4)*2", 21, [6, 4, 2], False),
    ("(6+4)*2 = 21", 20, [6, 4, 2], False),  # a stated result other than the target
    ("__import__('os').system('x')", 0, [], False),
    ("2**10", 1024, [2, 10], False),
    ("-6+4+2", 0, [6, 4, 2], False),  # no unary minus
    ("6/(4-4)+2", 2, [6, 4, 4, 2], False),  # division by zero
    ("1.5*4", 6, [1, 4], False),
    ("6//4+2", 3, [6, 4, 2], False),
    ("6%4+2", 4, [6, 4, 2], False),
    ("0x6+4*2", 14, [6, 4, 2], False),  # only plain decimal literals
    ("True+4*2", 9, [1, 4, 2], False),
    ("x+4*2", 14, [6, 4, 2], False),
    ("(6+4)*2 == 20", 20, [6, 4, 2], False),
    ("", 0, [], False),
]


@pytest.mark.parametrize("text, target, numbers, expected", HAND_CASES)
def test_hand_cases(text, target, numbers, expected):
    assert check_countdown(text, target, numbers) is expected


def test_model_text_is_never_run(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    assert parse_expression("__import__('os').system('x')") is None
    assert not check_countdown("__import__('os').system('x')", 0, [])
    assert calls == []


def test_long_and_deep_texts_are_refused_quickly():
    start = time.perf_counter()
    for text in ("1+" * 5000, " " * 10_000, "(" * 10_000 + "1" + ")" * 10_000, "9" * 10_000, "=" * 10_000):
        assert not check_countdown(text, 1, [1])
    assert time.perf_counter() - start < 0.5
    assert parse_expression("1+" * (MAX_DEPTH - 1) + "1") is not None
    assert parse_expression("1+" * MAX_DEPTH + "1") is None


def test_parse_evaluate_and_numbers_in_order():
    expr = parse_expression("(3 + 5) * 2 - 12 / 8")
    assert numbers_used(expr) == [3, 5, 2, 12, 8]
    assert evaluate(expr) == Fraction(29, 2)


@st.composite
def trees(draw):
    """(fully parenthesised text, exact value or None on division by zero, its numbers in another order)."""
    numbers = draw(st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=6))
    return *_tree(draw, numbers), draw(st.permutations(numbers))


def _tree(draw, numbers):
    """A random tree over `numbers` in order: its text with every operation in parentheses, its value."""
    if len(numbers) == 1:
        return str(numbers[0]), Fraction(numbers[0])
    cut = draw(st.integers(min_value=1, max_value=len(numbers) - 1))
    (lt, lv), (rt, rv) = _tree(draw, numbers[:cut]), _tree(draw, numbers[cut:])
    op = draw(st.sampled_from("+-*/"))
    value = None if lv is None or rv is None or (op == "/" and rv == 0) else OPERATORS[op](lv, rv)
    return f"({lt} {op} {rt})", value


@given(trees(), st.integers(min_value=-50, max_value=50), st.booleans())
@settings(max_examples=500, deadline=None)
def test_random_trees_evaluate_exactly(tree, other_target, aim):
    text, value, shuffled = tree
    assert evaluate(parse_expression(text)) == value
    hits = aim and value is not None and value.denominator == 1
    target = int(value) if hits else other_target
    assert check_countdown(text, target, shuffled) is (value == target)


@given(st.text(st.characters(codec="ascii", categories=["L", "N", "P", "S", "Zs"]), max_size=40),
       st.integers(min_value=-5, max_value=50), st.lists(st.integers(min_value=0, max_value=20), max_size=4))
@settings(max_examples=500, deadline=None)
def test_random_text_never_raises(text, target, numbers):
    assert isinstance(check_countdown(text, target, numbers), bool)


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=2, max_value=6),
       st.integers(min_value=10, max_value=30))
@settings(max_examples=50, deadline=None)
def test_generator_is_seeded_solvable_and_disjoint(seed, n_numbers, max_number):
    train, held_out = generate_countdown(40, 20, seed, n_numbers, max_number)
    assert (train, held_out) == generate_countdown(40, 20, seed, n_numbers, max_number)
    assert len(train) == 40 and len(held_out) == 20
    for p in train + held_out:
        assert len(p["numbers"]) == n_numbers and all(1 <= n <= max_number for n in p["numbers"])
        assert 1 <= p["target"] <= 1000
        assert check_countdown(p["solution"], p["target"], p["numbers"]), p
    keys = {(tuple(sorted(p["numbers"])), p["target"]) for p in held_out}
    assert len(keys) == len(held_out)  # the held-out problems are distinct
    assert not keys & {(tuple(sorted(p["numbers"])), p["target"]) for p in train}


def test_generator_row_shape():
    (first, *_), _ = generate_countdown(3, 2, seed=7)
    assert set(first) == {"id", "question", "numbers", "target", "solution"}
    assert first["id"] == "countdown-0"
    assert first["question"] == (f"Using the numbers {first['numbers']} each exactly once, with + - * / and "
                                 f"parentheses, make {first['target']}.")
    assert generate_countdown(3, 2, seed=8) != generate_countdown(3, 2, seed=7)


@pytest.mark.parametrize("kwargs", [dict(train_size=0), dict(eval_size=0), dict(n_numbers=1), dict(n_numbers=7),
                                    dict(max_number=0)])
def test_generator_refuses_bad_settings(kwargs):
    args = dict(train_size=5, eval_size=5, seed=0) | kwargs
    with pytest.raises(ValueError, match="countdown: ") as info:
        generate_countdown(**args)
    assert "\n" not in str(info.value)


def test_generator_says_when_too_few_problems_exist():
    with pytest.raises(ValueError, match="new problems"):
        generate_countdown(1, 8, seed=0, n_numbers=2, max_number=2)
