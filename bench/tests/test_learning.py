"""The statistics of bench/learning.py: the plateau check, the two-level bootstrap, and the report of
one finished pipeline run (its evaluate stage's predictions)."""

import csv
import random

import numpy as np
import pytest

from bench.learning import bootstrap, plateau_move, report, scored_run


def test_plateau_move_compares_the_last_check_with_the_one_nearest_80_percent():
    curve = [(250, 0.10), (500, 0.40), (750, 0.55), (1000, 0.58), (1250, 0.60)]
    assert plateau_move(curve) == pytest.approx(0.60 - 0.58)  # 80% of 1250 = 1000
    assert plateau_move([(100, 0.5)]) is None


def test_bootstrap_point_and_degenerate_cases():
    rng = np.random.default_rng(0)
    same = [[1, 0, 1, 1]] * 3  # every seed identical, so only the problems vary
    mean, low, high = bootstrap(same, rng)
    assert mean == pytest.approx(0.75) and 0.0 <= low < 0.75 < high <= 1.0
    assert bootstrap([[1] * 10] * 3, rng) == (1.0, 1.0, 1.0)  # nothing varies: a zero-width interval


def test_bootstrap_covers_the_truth_of_a_known_coin():
    """Three 'seeds' of 200 problems from a 0.6 coin: the 95% interval contains 0.6 in ~95% of trials."""
    rng, hits, trials = random.Random(1), 0, 100
    for _ in range(trials):
        seeds = [[int(rng.random() < 0.6) for _ in range(200)] for _ in range(3)]
        _, low, high = bootstrap(seeds, np.random.default_rng(rng.randrange(2**32)), draws=1000)
        hits += low <= 0.6 <= high
    assert hits >= 0.85 * trials


def test_a_finished_run_is_reported_paired_from_its_predictions(tmp_path):
    """reports/predictions_<stage>_arith.csv as the evaluate stage writes them (pandas: True/False):
    the paired difference counts the problems each of warmup and control alone solves."""
    correct = {"sft": [0, 0, 1, 1, 0], "control": [1, 0, 1, 0, 0], "warmup": [1, 1, 1, 1, 0]}
    (tmp_path / "reports").mkdir()
    (tmp_path / "plots").mkdir()
    for stage, col in correct.items():
        with open(tmp_path / "reports" / f"predictions_{stage}_arith.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "gold", "correct"])
            w.writerows([[i, i, str(bool(c))] for i, c in enumerate(col)])
    (tmp_path / "plots" / "sft.csv").write_text("step,loss,val_loss,arith_accuracy\n100,1.0,,\n"
                                                 "800,0.5,0.6,0.40\n1000,0.4,0.5,0.41\n")
    run = scored_run(tmp_path)
    assert run["correct"] == correct and run["sft_curve"] == [(800, 0.40), (1000, 0.41)]
    table = report([run])
    assert table["warmup_minus_control"]["mean"] == pytest.approx(0.4)  # 2 of 5 problems, none the other way
    assert table["discordant"] == [[2, 0]]  # problems 1 and 3: the warmup only; none: the control only
    assert table["sft_plateau_move"] == [pytest.approx(0.01)]
