"""The verifier against its hand-labelled set, tests/fixtures/verifier_labelled.jsonl (616 realistic
completions: GSM8K-style and curriculum reasoning crossed with answer spellings, wrong answers and
hacks, then the red team's findings, misreadings, precision, units, tags and boxes; the labelling
rules are in tests/fixtures/verifier_labelled_make.py, which writes the file).

A false positive (an `incorrect` completion earning the +1.0) is a reward hack, so there must be none.
False negatives (a `correct` completion the grammar does not credit) are the grammar's known limits,
16 of 276, all listed in KNOWN_FALSE_NEGATIVES: a sign parted from its digits (`- 5`), number words
(`eighteen`), a percent against a fraction gold (`25%` for 0.25), cents against a dollar gold,
`5°C below zero` (ambiguous, not negated), two numbers in one answer (`18, not 20`, `85 85`,
`1 hour 30 minutes`, a boxed `5 hours and 30 minutes`, `1 500 000`, reasoning inside the tag,
`0.5 = 50%`), a number glued to a word (`is5`), and a last number after the answer in untagged text
(`... Note: this assumes 2 months.`).
"""

import json
from collections import Counter

import pytest

from tests.conftest import REPO

from pipeline.rewards.verifiers import CORRECT_BONUS, reward_gsm8k

ROWS = [json.loads(line) for line in (REPO / "tests/fixtures/verifier_labelled.jsonl").read_text("utf-8").splitlines()]

KNOWN_FALSE_NEGATIVES = {
    "<answer>\u2212 5</answer>", "<answer>- 5</answer>", "<answer>25%</answer>", "<answer>eighteen</answer>",
    "<answer>forty-two</answer>", "<answer>5\u00b0C below zero</answer>",
    "<answer>48/2 = 24 clips in May, 48 + 24 = 72 clips in total</answer>",
    "<answer>The answer is 18, not 20.</answer>", "The answer is5", "<answer>85 85</answer>",
    "The answer is 72.\n\nNote: this assumes 2 months.", "<answer>50 cents</answer>",
    "<answer>1 hour 30 minutes</answer>", "<answer>1 500 000</answer>", "<answer>0.5 = 50%</answer>",
    "\\boxed{5\\text{ hours and }30\\text{ minutes}}",
}


def _credited(row) -> bool:
    return reward_gsm8k(row["completion"], row["gold"]) >= CORRECT_BONUS


def test_the_set_is_large_labelled_and_unique():
    assert len(ROWS) >= 300
    labels = Counter(r["label"] for r in ROWS)
    assert set(labels) == {"correct", "incorrect"} and min(labels.values()) >= 100
    assert all(isinstance(r["gold"], float) and r["note"] and isinstance(r["completion"], str) for r in ROWS)
    assert len({(r["completion"], r["gold"]) for r in ROWS}) == len(ROWS)


def test_no_false_positive():
    false_positives = [(r["completion"], r["gold"], r["note"]) for r in ROWS
                       if r["label"] == "incorrect" and _credited(r)]
    assert not false_positives


def test_false_negatives_are_the_known_few():
    false_negatives = {r["completion"] for r in ROWS if r["label"] == "correct" and not _credited(r)}
    assert false_negatives <= KNOWN_FALSE_NEGATIVES, false_negatives - KNOWN_FALSE_NEGATIVES
    assert len(false_negatives) <= 16


@pytest.mark.parametrize("row", [r for r in ROWS if r["note"].startswith("finding:")], ids=lambda r: r["note"])
def test_every_finding_in_the_set_is_scored_by_its_label(row):
    assert _credited(row) == (row["label"] == "correct")
