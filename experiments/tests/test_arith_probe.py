"""The error classifier of experiments/arith_probe.py (an experiment's tool, so its test lives beside it, not in
tests/)."""

from hypothesis import given
from hypothesis import strategies as st

from experiments.arith_probe import calc, classify_error, tally

SOLUTION = "0 + 6 = 6.\n10 + 6 = 16.\n6 * 9 = 54.\n1 * 9 + 5 = 14.\n16 * 9 = 144.\n<answer>144</answer>"


def test_calc_reads_worked_lines_with_precedence():
    assert calc("7 + 8") == 15
    assert calc("1 * 9 + 5") == 14
    assert calc("3 + 7 * 7") == 52
    assert calc("12 - 1 - 2") == 9
    assert calc("4 + 6 + 1") == 11
    for bad in ("", "7 +", "7 + x", "7 / 2", "7 8", "__import__('os') + 1"):
        assert calc(bad) is None


@given(st.lists(st.integers(0, 99), min_size=1, max_size=6), st.data())
def test_calc_equals_sum_of_products(values, data):
    ops = [data.draw(st.sampled_from("+-*")) for _ in values[1:]]
    text = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
    terms, signs = [values[0]], [1]  # reference: products of the `*` runs, signed by the op before each run
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    assert calc(text) == sum(s * t for s, t in zip(signs, terms))


def test_classify_error_names_the_first_differing_line():
    def with_line(i: int, line: str) -> str:
        lines = SOLUTION.split("\n")
        return "\n".join(lines[:i] + [line] + lines[i + 1:])

    assert classify_error(SOLUTION, with_line(1, "10 + 6 = 15.")) == "fact"  # gold operands, wrong result
    assert classify_error(SOLUTION, with_line(1, "10 + 8 = 16.")) == "copy"  # miscopied, gold's result
    assert classify_error(SOLUTION, with_line(2, "6 * 8 = 48.")) == "copy"  # miscopied, consistent result
    assert classify_error(SOLUTION, with_line(2, "6 * 8 = 50.")) == "both"
    assert classify_error(SOLUTION, with_line(5, "<answer>145</answer>")) == "answer"
    assert classify_error(SOLUTION, with_line(5, "16 + 9 = 25.")) == "line"  # a line where the gold answers
    assert classify_error(SOLUTION, with_line(0, "zero plus six")) == "format"
    assert classify_error(SOLUTION, SOLUTION.rsplit("\n", 1)[0]) == "line"  # stops before the answer
    # only the FIRST differing line counts: a later fact error after a copy error is a copy error
    assert classify_error(SOLUTION, with_line(1, "10 + 8 = 18.").replace("6 * 9 = 54.", "6 * 9 = 55.")) == "copy"


def test_the_tally_per_level_hand_computed():
    """Two levels, k = 4: level 1's two problems are all right (not mixed) and 3 of 4 right (mixed);
    level 2's one problem is all wrong (not mixed, no pass)."""
    rows = [{"level": 1}, {"level": 1}, {"level": 2}]
    hits = [[True] * 4, [True, False, True, True], [False] * 4]
    out = tally(rows, [True, False, False], hits)
    assert list(out) == ["1", "2", "all"]
    assert out["1"] == {"greedy": 0.5, "sample": 0.875, "pass": 1.0, "mixed": 0.5, "n": 2}
    assert out["2"] == {"greedy": 0.0, "sample": 0.0, "pass": 0.0, "mixed": 0.0, "n": 1}
    assert out["all"] == {"greedy": 0.3333, "sample": 0.5833, "pass": 0.6667, "mixed": 0.3333, "n": 3}
