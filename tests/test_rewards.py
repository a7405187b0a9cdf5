"""Parser and verifier: hand cases plus hypothesis properties (never raises, reward set, round-trips)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rewards.parsing import extract_answer, is_single_number
from pipeline.rewards.verifiers import (CORRECT_BONUS, FORMAT_BONUS, has_well_formed_answer,
                                        reward_arith, reward_for, reward_gsm8k)


@pytest.mark.parametrize("text,expected", [
    ("<answer>42</answer>", 42.0),
    ("so 3-5 = -2 <answer>-2</answer>", -2.0),
    ("She earns $1,234.50.", 1234.5),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", 72.0),
    ("#### 1,000,000", 1_000_000.0),
    ("<answer>3/4</answer>", 0.75),
    ("The answer is 18.", 18.0),
    ("<answer>$7</answer> then 9", 7.0),
    ("<answer>no number</answer> but 5 later", None),  # no fall-through past a tag
    ("<answer>1</answer> ... <answer>2</answer>", None),  # blocks that disagree
    ("nothing here", None),
    ("<answer>5/0</answer>", None),
    ("", None),
])
def test_extract_answer_cases(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text,gold,reward", [
    ("<answer>42</answer>", 42, 1.2),
    ("Thus 40 + 2 = 42. <answer>42</answer>", 42.0, 1.2),
    ("<answer>41</answer>", 42, 0.2),
    ("the answer is 42", 42, 1.0),
    ("<answer></answer>", 42, 0.0),          # the empty-tag hack earns nothing
    ("<answer>  </answer> 42", 42, 0.0),     # a blank tag is a non-answer: no fall-through
    ("<answer>42</answer><answer>42</answer>", 42, 1.0),  # two blocks: no format bonus
    ("<answer>forty-two</answer>", 42, 0.0),
    ("<answer>42.00001</answer>", 42, 0.2),   # exact: no tolerance
    ("<answer>42.001</answer>", 42, 0.2),
    ("<answer>42</answer>", None, 0.2),       # gold None: format only
])
def test_reward_cases(text, gold, reward):
    assert reward_gsm8k(text, gold) == pytest.approx(reward)


def test_constants_match_the_reference_chapter():
    assert (CORRECT_BONUS, FORMAT_BONUS) == (1.0, 0.2)
    assert reward_for("arith") is reward_arith and reward_for("gsm8k") is reward_gsm8k
    with pytest.raises(ValueError, match="known"):
        reward_for("code")


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_never_raises_and_reward_in_set(text):
    for gold in (None, 0.0, 42.0):
        assert reward_gsm8k(text, gold) in {0.0, 0.2, 1.0, 1.2}
    extract_answer(text)


_tag_soup = st.lists(st.sampled_from(["<answer>", "</answer>", "####", "-", "$", ",", ".", "/", "1", "42", " ", "x"]))


@given(_tag_soup)
@settings(max_examples=300, deadline=None)
def test_never_raises_on_tag_soup(parts):
    text = "".join(parts)
    assert reward_gsm8k(text, 42.0) in {0.0, 0.2, 1.0, 1.2}


@given(st.integers(min_value=-10**12, max_value=10**12), st.booleans(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_commas_dollars_negatives_round_trip(n, commas, dollar):
    body = f"{abs(n):,}" if commas else str(abs(n))
    body = ("$" if dollar else "") + body
    text = f"So the total is {'-' if n < 0 else ''}{body}."
    assert extract_answer(text) == float(n)
    tagged = f"work... <answer>{'-' if n < 0 else ''}{body}</answer>"
    assert extract_answer(tagged) == float(n)
    assert reward_gsm8k(tagged, float(n)) == pytest.approx(1.2)
    assert has_well_formed_answer(tagged)


@given(st.decimals(min_value=-10**6, max_value=10**6, places=3, allow_nan=False, allow_infinity=False))
@settings(max_examples=200, deadline=None)
def test_decimals_round_trip(d):
    text = f"<answer>{d}</answer>"
    assert extract_answer(text) == pytest.approx(float(d))
    assert is_single_number(str(d))


@pytest.mark.parametrize("text", [
    "<answer>" * 200_000,
    "</answer>" * 120_000,
    "1," * 500_000,
    "-" * 1_000_000,
    "<answer>1" + " " * 1_000_000,
    "####" * 250_000,
    "9" * 1_000_000,
])
@pytest.mark.timeout(10)
def test_adversarial_megabyte_terminates(text):
    # A quadratic parser takes minutes on 1 MB; the linear one takes milliseconds (see bench/rewards.py).
    # The timeout is a hang guard, not a performance assertion.
    assert reward_gsm8k(text, 1.0) in {0.0, 0.2, 1.0, 1.2}
