"""prepare: GSM8K loading from every local format, row validation and the bad-row rule, solution
rewriting, the arithmetic curriculum (seeded, exact, disjoint) and a small end-to-end prepare run."""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import time
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.config_loading import load_config
from pipeline.core.errors import InputError
from pipeline.data import arithmetic as ar
from pipeline.data import gsm8k as gs
from pipeline.data.prompts import format_number, format_prompt
from tests.conftest import GOOD, GOOD_TEST, GSM8K, REPO, TEMPLATE, write_jsonl

# --------------------------------------------------------------------------- answers and rewriting

@pytest.mark.parametrize("answer, gold", [
    ("x\n#### 72", 72.0), ("#### 1,234", 1234.0), ("#### -5", -5.0), ("#### 3.5", 3.5),
    ("a #### b\n####  12 \n", 12.0), ("#### 109,200,000", 109200000.0), ("#### .5", 0.5),
])
def test_parse_gold(answer, gold):
    assert gs.parse_gold(answer) == gold


@pytest.mark.parametrize("answer, why", [
    ("72", "no '#### N'"), ("#### seventy", "not a number"), ("#### ", "not a number"),
    ("#### 1,23", "not a number"), ("#### 12 apples", "not a number"), ("#### 1e5", "not a number"),
])
def test_parse_gold_rejects(answer, why):
    with pytest.raises(ValueError, match=why):
        gs.parse_gold(answer)


def test_rewrite_solution_hand_checked():
    assert gs.rewrite_solution(GOOD[0]["answer"]) == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n<answer>72</answer>")
    assert gs.rewrite_solution(GOOD[1]["answer"]) == "1,000 + 234 = 1,234\n<answer>1234</answer>"
    assert gs.rewrite_solution(GOOD[2]["answer"]) == "2 - 5 = -3\n<answer>-3</answer>"
    assert gs.rewrite_solution(GOOD[3]["answer"]) == "7 / 2 = 3.5\n<answer>3.5</answer>"
    assert gs.rewrite_solution("#### 4") == "<answer>4</answer>"


def test_prompt_and_numbers():
    assert format_prompt(" What is {x}? ", TEMPLATE) == "Q: What is {x}?\nA:"  # braces are harmless
    assert [format_number(x) for x in (72.0, -3.0, 3.5, 1234.0, 0.0)] == ["72", "-3", "3.5", "1234", "0"]


def test_row_schema():
    row = gs.make_row(gs.RawRow(7, "f:8", GOOD[0]), "train", TEMPLATE)
    assert row == {"id": "gsm8k-train-00007", "source": "gsm8k", "question": GOOD[0]["question"],
                   "prompt": f"Q: {GOOD[0]['question']}\nA:", "gold": 72.0,
                   "solution": gs.rewrite_solution(GOOD[0]["answer"]), "level": 0}


# --------------------------------------------------------------------------- sources

@pytest.fixture
def sources(tmp_path):
    """The same two splits as a JSONL pair, a Parquet pair, a folder and hub-style shards."""
    train, test = GOOD * 3, GOOD_TEST[:2]
    write_jsonl(tmp_path / "jsonl" / "gsm8k_train.jsonl", train)
    write_jsonl(tmp_path / "jsonl" / "gsm8k_test.jsonl", test)
    (tmp_path / "pq").mkdir()
    pd.DataFrame(train).to_parquet(tmp_path / "pq" / "train.parquet")
    pd.DataFrame(test).to_parquet(tmp_path / "pq" / "test.parquet")
    write_jsonl(tmp_path / "folder" / "train.jsonl", train)
    write_jsonl(tmp_path / "folder" / "test.jsonl", test)
    shards = tmp_path / "snapshot" / "main"
    shards.mkdir(parents=True)
    pd.DataFrame(train[:5]).to_parquet(shards / "train-00000-of-00002.parquet")
    pd.DataFrame(train[5:]).to_parquet(shards / "train-00001-of-00002.parquet")
    pd.DataFrame(test).to_parquet(shards / "test-00000-of-00001.parquet")
    return tmp_path


def _rows(source) -> dict:
    raw = gs.load_raw(str(source))
    return {s: gs.validate_split(raw[s], s, TEMPLATE, 0.0, str(source))[0] for s in gs.SPLITS}


def test_jsonl_parquet_folder_and_shards_give_the_same_rows(sources):
    expected = _rows(sources / "jsonl" / "gsm8k_train.jsonl")
    assert len(expected["train"]) == 12 and len(expected["test"]) == 2
    assert _rows(sources / "jsonl" / "gsm8k_test.jsonl") == expected  # either file of the pair
    assert _rows(sources / "pq" / "train.parquet") == expected
    assert _rows(sources / "folder") == expected
    assert _rows(sources / "snapshot") == expected  # <folder>/<config>/ shards, in order


def test_the_committed_gsm8k_copy_is_the_default_whole_and_valid(monkeypatch):
    """datasets/gsm8k is data.gsm8k_source's default: intact (its README's SHA-256), both splits whole,
    every row valid, resolved from the repo root as DVC runs the stage; the test fixture is its head."""
    import hashlib

    folder = REPO / "datasets" / "gsm8k"
    sums = dict(reversed(line.split()) for line in (folder / "README.md").read_text().splitlines()
                if re.fullmatch(r"[0-9a-f]{64}  \S+", line))
    assert set(sums) == {"train.jsonl", "test.jsonl"}
    for name, digest in sums.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    default = load_config(REPO / "params.yaml").data.gsm8k_source
    monkeypatch.chdir(REPO)
    raw = gs.load_raw(default)
    rows = {s: gs.validate_split(raw[s], s, TEMPLATE, 0.0, default) for s in gs.SPLITS}
    assert {s: (len(r), len(bad)) for s, (r, bad) in rows.items()} == {"train": (7473, 0), "test": (1319, 0)}
    fixture = gs.load_raw(str(GSM8K))
    for split, n in (("train", 80), ("test", 30)):
        assert [r.data for r in fixture[split]] == [r.data for r in raw[split][:n]]


def test_source_errors(sources, tmp_path):
    write_jsonl(tmp_path / "lonely" / "train.jsonl", GOOD)
    write_jsonl(tmp_path / "noname" / "gsm8k.jsonl", GOOD)
    write_jsonl(tmp_path / "both" / "train.jsonl", GOOD)
    pd.DataFrame(GOOD).to_parquet(tmp_path / "both" / "train.parquet")
    cases = [(tmp_path / "lonely" / "train.jsonl", "test split is missing"),
             (tmp_path / "lonely", "expected train and test files"),
             (tmp_path / "noname" / "gsm8k.jsonl", "must name its split"),
             (tmp_path / "both", "keep one"),
             ("./no/such/folder", "no such file or folder")]
    for source, message in cases:
        with pytest.raises(InputError, match=message):
            gs.load_raw(str(source))


def test_unreachable_hub_fails_fast_with_a_hint(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(InputError, match=r"--set data.gsm8k_source=/path/to/gsm8k"):
        gs.load_raw("openai/gsm8k", "main")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(gs, "_hub_reachable", lambda timeout=3.0: False)  # online mode, no network
    with pytest.raises(InputError, match=r"cannot be reached.*--set data.gsm8k_source="):
        gs.load_raw("openai/gsm8k", "main")
    assert time.monotonic() - start < 10


def test_malformed_rows_are_located_and_the_fraction_rule_applies(tmp_path):
    lines = [GOOD[0], {"question": "q", "answer": "no marker"}, GOOD[1],
             {"question": "q", "answer": "#### seven"}, {"question": "  ", "answer": "#### 3"},
             '{"question": "broken", ', GOOD[2], {"answer": "#### 4"}, "", GOOD[3], "[1, 2]",
             '{"question": "q", "answer": "#### 1", "n": ' + "1" * 5000 + "}"]
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    raws = gs.read_jsonl(path)
    assert len(raws) == 11  # the blank line is not a row
    rows, bad = gs.validate_split(raws, "train", TEMPLATE, 0.7, str(path))
    assert len(rows) == 4
    assert [(b.location, b.reason.split(" (")[0]) for b in bad] == [
        (f"{path}:2", "answer has no '#### N' final line"),
        (f"{path}:4", "final answer 'seven' after '####' is not a number"),
        (f"{path}:5", "missing or empty 'question'"),
        (f"{path}:6", "invalid JSON"),
        (f"{path}:8", "missing or empty 'question'"),
        (f"{path}:11", "expected a JSON object, got list"),
        (f"{path}:12", "invalid JSON"),  # an integer of 5,000 digits: json's plain ValueError
    ]
    with pytest.raises(InputError, match=rf"7 of 11 train rows are malformed .* first: {path}:2: answer has no"):
        gs.validate_split(raws, "train", TEMPLATE, 0.5, str(path))
    with pytest.raises(InputError, match="no rows"):
        gs.validate_split([], "test", TEMPLATE, 0.5, str(path))


# --------------------------------------------------------------------------- arithmetic curriculum

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(expr: str) -> int:
    """Independent check of an expression the generator built: Python's own parser and precedence,
    integers and + - * only (anything else fails the test), no eval."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        assert isinstance(node, ast.BinOp) and type(node.op) in _OPS, ast.dump(node)
        return _OPS[type(node.op)](ev(node.left), ev(node.right))
    return ev(ast.parse(expr, mode="eval").body)


@settings(max_examples=200, deadline=None)
@given(level=st.integers(1, ar.MAX_LEVEL), seed=st.integers(0, 2**32))
def test_every_problem_is_exactly_right(level, seed):
    p = ar.sample_problem(level, random.Random(seed))
    assert p.level == level and p.answer == _value(p.expr) >= 0
    for step in p.steps:  # every worked line is true, and the last one is the answer
        lhs, rhs = step.split(" = ")
        assert _value(lhs) == int(rhs)
    assert int(p.steps[-1].split(" = ")[1]) == p.answer
    assert ar.solution_text(p).endswith(f".\n<answer>{p.answer}</answer>")


@pytest.mark.parametrize(("a", "op", "b", "lines"), [
    (47, "+", 38, ["7 + 8 = 15", "4 + 3 + 1 = 8", "47 + 38 = 85"]),
    (3, "+", 20, ["3 + 0 = 3", "3 + 20 = 23"]),  # the lone tens digit is copied, no line
    (999, "+", 1, ["9 + 1 = 10", "9 + 1 = 10", "9 + 1 = 10", "999 + 1 = 1000"]),
    (83, "-", 29, ["13 - 9 = 4", "8 - 1 - 2 = 5", "83 - 29 = 54"]),
    (105, "-", 98, ["15 - 8 = 7", "10 - 1 - 9 = 0", "1 - 1 = 0", "105 - 98 = 7"]),
    (1000, "-", 1, ["10 - 1 = 9", "10 - 1 = 9", "10 - 1 = 9", "1 - 1 = 0", "1000 - 1 = 999"]),
    (34, "*", 7, ["4 * 7 = 28", "3 * 7 + 2 = 23", "34 * 7 = 238"]),
    (5, "*", 34, ["4 * 5 = 20", "3 * 5 + 2 = 17", "5 * 34 = 170"]),
    (7, "+", 5, ["7 + 5 = 12"]),  # a one-digit fact is its own step
])
def test_digit_columns_by_hand(a, op, b, lines):
    assert ar.worked_lines(a, op, b) == lines


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 9999), op=st.sampled_from("+-*"), b=st.integers(0, 9999))
def test_digit_columns_are_true_one_digit_steps(a, op, b):
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        b %= 10
    *cols, last = ar.worked_lines(a, op, b)
    assert last == f"{a} {op} {b} = {_value(f'{a} {op} {b}')}"
    for line in cols:
        lhs, rhs = line.split(" = ")
        assert _value(lhs) == int(rhs)
        # a column step only ever needs one-digit facts: digits, a carry/borrow of 1 (or a
        # multiplication carry below 10) and at most one borrowed ten
        nums = [int(t) for t in lhs.split() if t.isdigit()]
        assert all(n <= 19 for n in nums) and len(nums) <= 3
    assert len(cols) <= max(len(str(a)), len(str(b))) + 1


@settings(max_examples=200, deadline=None)
@given(level=st.integers(1, ar.MAX_LEVEL), seed=st.integers(0, 2**32))
def test_solution_styles(level, seed):
    p = ar.sample_problem(level, random.Random(seed))
    lines = ar.solution_text(p, "lines")
    assert lines == "".join(f"{s}.\n" for s in p.steps) + f"<answer>{p.answer}</answer>"
    digits = ar.solution_text(p, "digits")
    body = digits.removesuffix(f"<answer>{p.answer}</answer>").rstrip("\n").split("\n")
    for line in body:  # every worked line is true
        lhs, rhs = line.removesuffix(".").split(" = ")
        assert _value(lhs) == int(rhs)
    rest = iter(b.removesuffix(".") for b in body)  # each operation's whole line, in order
    assert all(step in rest for step in p.steps)
    assert body[-1] == f"{p.steps[-1]}."
    with pytest.raises(ValueError, match="'words' is not one of"):
        ar.solution_text(p, "words")


def test_levels_match_their_description():
    rng = random.Random(0)
    for _ in range(300):
        one = ar.sample_problem(1, rng)
        assert all(len(t) == 1 for t in one.expr.split() if t.isdigit())
        two = ar.sample_problem(2, rng)
        assert all(len(t) == 2 for t in two.expr.split() if t.isdigit())
        assert len(ar.sample_problem(4, rng).steps) == 2
        five = ar.sample_problem(5, rng)
        assert any(len(t.strip("()")) == 3 for t in five.expr.split())


def _expr(question: str) -> str:
    match = re.fullmatch(r"(?:What is|Compute|Calculate|Find the value of) (.+)[?.]", question)
    assert match, question
    return match.group(1)


def test_curriculum_is_seeded_balanced_and_disjoint():
    train, held = ar.generate_curriculum(400, 40, 4, seed=3, template=TEMPLATE)
    again = ar.generate_curriculum(400, 40, 4, seed=3, template=TEMPLATE)
    other = ar.generate_curriculum(400, 40, 4, seed=4, template=TEMPLATE)
    assert (train, held) == again and (train, held) != other
    assert len(train) == 400 and len(held) == 40
    assert [sum(r["level"] == lv for r in train) for lv in (1, 2, 3, 4)] == [100] * 4
    assert [sum(r["level"] == lv for r in held) for lv in (1, 2, 3, 4)] == [10] * 4
    held_exprs = {_expr(r["question"]) for r in held}
    assert len(held_exprs) == 40  # distinct held-out problems ...
    assert not held_exprs & {_expr(r["question"]) for r in train}  # ... none of them trained on
    for r in train + held:
        assert r["source"] == "arith" and r["prompt"] == format_prompt(r["question"], TEMPLATE)
        assert r["gold"] == _value(_expr(r["question"]))
        assert r["solution"].endswith(f"<answer>{int(r['gold'])}</answer>")


def test_curriculum_refuses_an_impossible_held_out_size():
    with pytest.raises(InputError, match="data.arith_eval_size = 400 is too large: level 1"):
        ar.generate_curriculum(10, 400, 1, seed=0, template=TEMPLATE)  # level 1 has 155 problems


# --------------------------------------------------------------------------- the stage

def test_the_gsm8k_fixture_is_real_and_clean():
    """The fixture is the head of the real dataset: every row passes validation, and the known first
    rows are there (so the tests exercise real GSM8K text, not hand-written look-alikes)."""
    raw = gs.load_raw(str(GSM8K))
    for split, n in (("train", 80), ("test", 30)):
        rows, bad = gs.validate_split(raw[split], split, TEMPLATE, 0.0, str(GSM8K))
        assert len(rows) == n and not bad
    assert raw["train"][0].data["question"].startswith("Natalia sold clips to 48 of her friends")
    assert raw["test"][0].data["answer"].endswith("#### 18")
    assert "MIT License" in (GSM8K / "LICENSE").read_text()


def test_run_prepare_end_to_end_is_deterministic(tmp_path, monkeypatch):
    from pipeline.stages.prepare import SPLIT_FILES, run_prepare

    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "smoke.yaml", [f"data.gsm8k_source={GSM8K}"])
    out = run_prepare(cfg)
    assert out["counts"] == {"gsm8k_train": 80 - 20, "gsm8k_val": 20, "gsm8k_test": 30,
                             "arith_train": 400, "arith_eval": 16}
    assert out["rejected"] == 0
    files = sorted(Path("data").iterdir())
    assert [f.name for f in files] == sorted([f"{n}.jsonl" for n in SPLIT_FILES] + ["stats.json", "tasks", "tokenizer.json"])
    first = {f.name: f.read_bytes() for f in files if f.is_file()}
    run_prepare(cfg)
    assert {f.name: f.read_bytes() for f in sorted(Path("data").iterdir()) if f.is_file()} == first  # byte-identical
    assert json.loads(Path("data/tasks/index.json").read_text())["gsm8k"]["test"] == "gsm8k_test.jsonl"
    keys = ["id", "source", "question", "prompt", "gold", "solution", "level"]
    rows = {name: [json.loads(x) for x in first[f"{name}.jsonl"].decode().split("\n") if x] for name in SPLIT_FILES}
    for name in SPLIT_FILES:
        assert all(list(r) == keys and r["solution"].endswith("</answer>") for r in rows[name])
    assert not {r["id"] for r in rows["gsm8k_val"]} & {r["id"] for r in rows["gsm8k_train"]}
    assert rows["gsm8k_test"][0]["id"] == "gsm8k-test-00000" and rows["gsm8k_test"][0]["gold"] == 18.0
    stats = json.loads(first["stats.json"])
    assert stats["rejected"]["train"] == 0 and stats["token_lengths"]["arith_eval"]["prompt"]["max"] > 0
    from pipeline.data.tokenizer import load_tokenizer

    assert load_tokenizer("data/tokenizer.json").vocab_size == 400


def test_run_prepare_fails_on_too_many_bad_rows(tmp_path, monkeypatch):
    from pipeline.stages.prepare import run_prepare

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "src" / "train.jsonl", GOOD * 5 + [{"question": "q", "answer": "oops"}])
    write_jsonl(tmp_path / "src" / "test.jsonl", GOOD_TEST)
    cfg = load_config(REPO / "configs" / "smoke.yaml",
                      ["data.gsm8k_source=src", "data.val_size=2", "data.max_bad_fraction=0.01"])
    with pytest.raises(InputError, match=r"src: 1 of 21 train rows are malformed.*train.jsonl:21"):
        run_prepare(cfg)
    assert not Path("data").exists()  # nothing written
    cfg.data.max_bad_fraction = 0.1
    out = run_prepare(cfg)
    assert out["rejected"] == 1 and out["counts"]["gsm8k_train"] == 18
    stats = json.loads(Path("data/stats.json").read_text())
    assert stats["rejected"]["rows"] == [{"split": "train", "location": "src/train.jsonl:21",
                                          "reason": "answer has no '#### N' final line"}]


def test_test_questions_copied_into_the_train_split_are_refused(tmp_path, monkeypatch):
    """A source whose train split holds a test question (case and spacing aside): one line naming the
    source, the count and the first pair, nothing written; a model would be scored on what it trained on."""
    from pipeline.stages.prepare import run_prepare

    monkeypatch.chdir(tmp_path)
    leaked = {**GOOD_TEST[1], "question": "  " + GOOD_TEST[1]["question"].upper().replace(" ", "  ")}
    write_jsonl(tmp_path / "src" / "train.jsonl", GOOD * 5 + [leaked])
    write_jsonl(tmp_path / "src" / "test.jsonl", GOOD_TEST)
    cfg = load_config(REPO / "configs" / "smoke.yaml", ["data.gsm8k_source=src", "data.val_size=2"])
    with pytest.raises(InputError, match=r"^src: 1 test question is also in the train split \(first: "
                                         r"gsm8k-test-00001 is gsm8k-train-00020\)"):
        run_prepare(cfg)
    assert not Path("data").exists()
    write_jsonl(tmp_path / "src" / "train.jsonl", GOOD * 5)
    assert run_prepare(cfg)["counts"]["gsm8k_test"] == len(GOOD_TEST)
