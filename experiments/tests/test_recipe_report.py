"""experiments/recipe_report.py: paired differences by hand, and the report over a small pipeline folder."""

from __future__ import annotations

import json

import pytest

from experiments import recipe_report as rr


def test_paired_difference_hand_computed():
    a = [True, True, True, False, True, False]
    b = [True, False, False, False, True, True]
    d = rr.paired(a, b, draws=2000)
    assert d["diff"] == pytest.approx(100 * (2 - 1) / 6) and (d["only_a"], d["only_b"], d["n"]) == (2, 1, 6)
    assert d["low"] <= d["diff"] <= d["high"]
    same = rr.paired(a, a, draws=500)
    assert (same["diff"], same["low"], same["high"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="not the same set"):
        rr.paired(a, b[:3], draws=10)


def test_report_pairs_every_entry_with_each_baseline_and_splits_levels(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"sft": {}, "sft_fewshot": {}, "warmup": {}}))
    (tmp_path / "data" / "arith_eval.jsonl").write_text("".join(json.dumps({"level": lv}) + "\n" for lv in (1, 2, 1, 2)))
    outcomes = {"sft": [0, 0, 1, 0], "sft_fewshot": [1, 0, 1, 0], "warmup": [1, 1, 1, 0]}
    for entry, cs in outcomes.items():
        for task in rr.TASKS:
            rows = "".join(f"q{i},{bool(c)}\n" for i, c in enumerate(cs))
            (tmp_path / "reports" / f"predictions_{entry}_{task}.csv").write_text("id,correct\n" + rows)
    table = rr.report(tmp_path, ["sft", "sft_fewshot"], draws=200)
    assert set(table) == {f"{t}: warmup - {b}" for t in rr.TASKS for b in ("sft", "sft_fewshot")}
    arith = table["arith: warmup - sft"]
    assert arith["all"]["diff"] == 50.0 and arith["level1"]["diff"] == 50.0 and arith["level2"]["diff"] == 50.0
    assert "level1" not in table["gsm8k: warmup - sft"]
    assert table["arith: warmup - sft_fewshot"]["all"]["only_a"] == 1
    assert "| arith: warmup - sft | all | +50.0" in rr.markdown(table)
