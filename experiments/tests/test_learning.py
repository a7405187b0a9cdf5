"""The statistics of experiments/learning.py: the plateau check, the two-level bootstrap, and the report of
one finished pipeline run (its evaluate stage's predictions)."""

import csv
import json
import random

import numpy as np
import pytest

from experiments.learning import (against, bootstrap, counted_twice, held_out_levels, plateau_move, report, run_seeds,
                                  scored_run)


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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bootstrap_is_a_95_percent_interval(seed):
    """One seed of 2,000 problems, 1,200 right: the interval's width is the normal 2 x 1.96 standard
    errors (a 90% interval would be 16% narrower, a 99% one 31% wider)."""
    problems = [1] * 1200 + [0] * 800
    mean, low, high = bootstrap([problems], np.random.default_rng(seed))
    assert mean == pytest.approx(0.6)
    assert high - low == pytest.approx(2 * 1.96 * (0.6 * 0.4 / 2000) ** 0.5, rel=0.06)
    assert low < 0.6 < high and abs((0.6 - low) - (high - 0.6)) < 0.004


def test_bootstrap_resamples_the_seeds():
    """Seeds that differ while each seed's problems agree: only the resampling of seeds gives width. The
    mean of three draws from {0.2, 0.5, 0.8} is 0.2 with probability 1/27 > 2.5%, so the interval is
    exactly [0.2, 0.8]; without resampling the seeds it would be the point 0.5."""
    mean, low, high = bootstrap([[0.2] * 10, [0.5] * 10, [0.8] * 10], np.random.default_rng(0))
    assert (mean, low, high) == pytest.approx((0.5, 0.2, 0.8))


def test_a_run_with_a_seed_already_under_work_is_caught(tmp_path):
    (tmp_path / "params.yaml").write_text("sft:\n  seed: 1\nwarmup:\n  seed: 1\ncontrol:\n  seed: 1\n")
    assert run_seeds(tmp_path) == [1, 1, 1]
    run = {"seed": "run", "stage_seeds": run_seeds(tmp_path)}
    assert counted_twice([{"seed": 1}, {"seed": 2}], run) == 1
    assert counted_twice([{"seed": 0}, {"seed": 2}], run) is None
    (tmp_path / "params.yaml").write_text("sft:\n  seed: 1\nwarmup:\n  seed: 3\ncontrol:\n  seed: 1\n")
    assert counted_twice([{"seed": 1}], {"stage_seeds": run_seeds(tmp_path)}) is None  # another seed set
    assert run_seeds(tmp_path / "missing") is None


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


def test_the_table_per_level_takes_only_that_levels_problems(tmp_path):
    """Two seeds, five problems of levels 1, 1, 2, 2, 2 (and a sixth row the scoring's limit left out):
    each level's accuracies are the mean over seeds of its own problems, and its paired difference
    counts only them."""
    rows = [{"id": f"arith-eval-{i:05d}", "source": "arith", "question": f"Compute {i} + 1.",
             "prompt": f"Question: Compute {i} + 1.\nAnswer:", "gold": float(i + 1),
             "solution": f"<answer>{i + 1}</answer>", "level": lv} for i, lv in enumerate([1, 1, 2, 2, 2, 3])]
    (tmp_path / "arith_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # as prepare writes it
    levels = held_out_levels(tmp_path)
    assert levels == [1, 1, 2, 2, 2, 3] and held_out_levels(tmp_path / "missing") is None
    seeds = [{"seed": 0, "correct": {"sft": [1, 0, 0, 0, 0], "control": [1, 1, 0, 0, 1], "warmup": [1, 1, 1, 1, 0]},
              "sft_curve": [], "wall_s": {}},
             {"seed": 1, "correct": {"sft": [1, 1, 0, 1, 0], "control": [1, 0, 0, 1, 0], "warmup": [1, 0, 1, 1, 1]},
              "sft_curve": [], "wall_s": {}}]
    table = report(seeds, levels)
    one, two = table["per_level"][1], table["per_level"][2]
    assert 3 not in table["per_level"]  # not scored
    assert (one["problems"], two["problems"]) == (2, 3)
    assert (one["sft"], one["control"], one["warmup"]) == (0.75, 0.75, 0.75)
    assert (two["sft"], two["control"], two["warmup"]) == pytest.approx((1 / 6, 1 / 3, 5 / 6), abs=1e-4)
    # level 1: every problem the same on both sides -> 0 with a degenerate interval
    assert one["warmup_minus_control"] == {"mean": 0.0, "ci95": [0.0, 0.0]}
    # level 2: seed 0 (+1, +1, -1), seed 1 (+1, 0, +1): mean over seeds of the per-problem mean = 0.5
    assert two["warmup_minus_control"]["mean"] == pytest.approx(0.5)
    low, high = two["warmup_minus_control"]["ci95"]
    assert -1 / 3 <= low < 0.5 < high <= 1.0
    # the whole table is unchanged by the levels
    assert report(seeds)["warmup_minus_control"] == table["warmup_minus_control"]
    with pytest.raises(SystemExit, match="not the set"):
        report(seeds, [1, 1, 2])


@pytest.mark.slow
def test_a_seed_is_scored_as_its_evaluate_stage_scores_it(tmp_path):
    """experiments/learning.py end to end on the smoke params (one seed: sft, then warmup and control side by
    side), then the pipeline's own evaluate stage in that seed's folder: the experiment's greedy pass gives
    the evaluate stage's completions and correctness on every held-out problem (same batch size,
    generation budget and verifier), so its seed-0 figures are the ones a pipeline run commits."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from experiments.learning import STAGES, greedy_predictions, seed_sets

    root = Path(__file__).resolve().parents[2]
    smoke, gsm8k = root / "configs" / "smoke.yaml", root / "tests" / "fixtures" / "gsm8k"
    work = tmp_path / "work"
    res = subprocess.run([sys.executable, str(root / "experiments" / "learning.py"), "--params", str(smoke),
                          "--gsm8k", str(gsm8k), "--seeds", "3", "--work", str(work)],
                         capture_output=True, text=True, check=False, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    table = json.loads(res.stdout.strip().splitlines()[-1])
    seed = work / "seed-3"
    scores = json.loads((seed / "scores.json").read_text())
    assert scores["seed"] == 3 and set(scores["wall_s"]) == set(STAGES)
    # the seed's stages ran with its own seed, and the table is its scores
    assert [table[s]["seeds"][0] for s in STAGES] == [round(sum(c) / len(c), 4) for c in
                                                     (scores["correct"][s] for s in STAGES)]
    overrides = ["tracking.enabled=false", "model.num_threads=1", *seed_sets(3)]
    evaluate = [sys.executable, "-m", "pipeline", "evaluate", "--params", "params.yaml",
                "--set", "evaluate.stages=[sft,control,warmup]", "--set", "evaluate.samples=0",
                "--set", "evaluate.gsm8k_limit=1"]
    for o in overrides:
        evaluate += ["--set", o]
    res = subprocess.run(evaluate, cwd=seed, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = greedy_predictions(seed, overrides)
    run = scored_run(seed)
    for stage in STAGES:
        with open(seed / "reports" / f"predictions_{stage}_arith.csv") as f:
            theirs = list(csv.DictReader(f))
        assert [p["completion"] for p in ours[stage]] == [r["completion"] for r in theirs], stage
        assert scores["correct"][stage] == run["correct"][stage], stage
    # --report --rescore scores the finished seed's checkpoints again and keeps the new scores
    stale = {**scores, "correct": {s: [1 - c for c in col] for s, col in scores["correct"].items()}}
    (seed / "scores.json").write_text(json.dumps(stale))
    res = subprocess.run([sys.executable, str(root / "experiments" / "learning.py"), "--work", str(work), "--report",
                          "--rescore"], capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((seed / "scores.json").read_text())["correct"] == scores["correct"]
    # --report --run: the pipeline run (here the seed's own folder, scored by its evaluate stage) is one
    # more row of the table, with the same figures as the seed
    res = subprocess.run([sys.executable, str(root / "experiments" / "learning.py"), "--work", str(work), "--report",
                          "--run", str(seed)], capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    both = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(both["discordant"]) == 2 and both["discordant"][0] == both["discordant"][1]
    assert all(both[s]["seeds"][0] == both[s]["seeds"][1] for s in STAGES)


def _sft_folder(root, name, smoke, data_text="1\n"):
    """A seed folder as the experiments lay it out: params.yaml and the data files the SFT reads."""
    import shutil

    folder = root / name / "seed-0"
    (folder / "data").mkdir(parents=True)
    shutil.copy(smoke, folder / "params.yaml")
    for f in ("arith_train.jsonl", "gsm8k_train.jsonl", "gsm8k_val.jsonl", "arith_eval.jsonl", "tokenizer.json"):
        (folder / "data" / f).write_text(data_text if f == "arith_train.jsonl" else f)
    return folder


def test_an_sft_is_taken_from_the_plateau_bench_only_if_it_is_this_seeds(tmp_path):
    """--sft-from: the plateau bench's SFT (run with its own checkpoint cadence, which changes no bit)
    is taken for a seed with the same params, overrides and data, and refused for any other."""
    import json
    from pathlib import Path

    from experiments.learning import adopt_sft, seed_sets

    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    base = ["tracking.enabled=false", "model.num_threads=1", "sft.steps=40"]
    src = _sft_folder(tmp_path, "plateau", smoke)
    (src / "checkpoints" / "sft").mkdir(parents=True)
    (src / "checkpoints" / "sft" / "config.json").write_text("{}")
    (src / "checkpoints" / "sft" / "model.safetensors").write_bytes(b"weights")
    (src / "plots").mkdir()
    (src / "plots" / "sft.csv").write_text("step,loss,val_loss,arith_accuracy\n40,1.0,2.0,0.5\n")
    theirs = [*base, "sft.seed=0", "sft.save_every=10", "sft.keep_last=3"]
    (src / "plateau.json").write_text(json.dumps({"overrides": theirs}))

    other_steps = _sft_folder(tmp_path, "steps", smoke)
    with pytest.raises(SystemExit, match="other params or data"):
        adopt_sft(src, other_steps, ["tracking.enabled=false", "model.num_threads=1", "sft.steps=50", *seed_sets(0)])
    other_seed = _sft_folder(tmp_path, "seed", smoke)
    with pytest.raises(SystemExit, match="other params or data"):
        adopt_sft(src, other_seed, [*base, *seed_sets(1)])
    other_data = _sft_folder(tmp_path, "data", smoke, data_text="2\n")
    with pytest.raises(SystemExit, match="other params or data"):
        adopt_sft(src, other_data, [*base, *seed_sets(0)])
    for refused in (other_steps, other_seed, other_data):
        assert not (refused / "checkpoints").exists()

    same = _sft_folder(tmp_path, "learning", smoke)
    adopt_sft(src, same, [*base, *seed_sets(0)])  # the plateau bench's save_every/keep_last set aside
    assert (same / "checkpoints" / "sft" / "model.safetensors").read_bytes() == b"weights"
    assert (same / "plots" / "sft.csv").read_text() == (src / "plots" / "sft.csv").read_text()
    assert not (same / "checkpoints" / ".sft.adopting").exists()

    (src / "plateau.json").unlink()  # an SFT the plateau bench has not finished
    with pytest.raises(SystemExit, match="no finished SFT"):
        adopt_sft(src, _sft_folder(tmp_path, "early", smoke), [*base, *seed_sets(0)])


def test_sft_from_is_refused_where_no_seed_trains(tmp_path):
    """--sft-from only means something when seeds are trained: with --report or --run it is an error
    (exit 2, one line), not silently ignored."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "learning.py"
    for extra in (["--work", str(tmp_path), "--report"], ["--run", str(tmp_path)]):
        res = subprocess.run([sys.executable, str(script), *extra, "--sft-from", str(tmp_path)],
                             capture_output=True, text=True, check=False, timeout=120)
        assert res.returncode == 2 and "--sft-from goes with training seeds" in res.stderr, res.stderr


def test_against_pairs_each_checkpoint_by_seed_and_problem():
    """Two recipes over seeds {0, 1} and {1, 2}: only seed 1 is paired; its warmup gained two of four
    problems and lost one (+1/4), the other checkpoints are unchanged (0, a degenerate interval)."""
    def seed(s, warmup):
        return {"seed": s, "correct": {"sft": [1, 0, 1, 0], "control": [1, 1, 0, 0], "warmup": warmup}}

    new = [seed(0, [1, 1, 1, 1]), seed(1, [1, 1, 1, 0])]
    old = [seed(1, [0, 0, 1, 1]), seed(2, [0, 0, 0, 0])]
    out = against(new, old, np.random.default_rng(0))
    assert out["seeds"] == [1]
    assert out["warmup"]["mean"] == 0.25 and out["warmup"]["seeds"] == [0.25]
    low, high = out["warmup"]["ci95"]
    assert -1.0 <= low < 0.25 < high <= 1.0  # four problems: a resample of all +1 is 6% likely
    assert out["sft"] == {"mean": 0.0, "ci95": [0.0, 0.0], "seeds": [0.0]}
    assert out["control"]["mean"] == 0.0
    with pytest.raises(SystemExit, match=r"no seed there ran here too \(here: \[0, 1\], there: \[5\]\)"):
        against(new, [seed(5, [0, 0, 0, 0])], np.random.default_rng(0))
    short = {"seed": 1, "correct": {"sft": [1], "control": [1], "warmup": [1]}}
    with pytest.raises(SystemExit, match="different held-out sets"):
        against(new, [short], np.random.default_rng(0))
