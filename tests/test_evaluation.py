"""Evaluation: scoring of hand-made completions, pass@k / maj@k, atomic and reproducible outputs."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core import files
from pipeline.core.config import Config
from pipeline.core.errors import InputError
from pipeline.rewards.task_rewards import Checker, TaskRewards
from pipeline.rl import evaluation as ev

# --------------------------------------------------------------------------- scoring


HAND_MADE = [  # (completion, gold, correct, well_formed)
    ("6 * 7 = 42 <answer>42</answer>", 42.0, True, True),
    ("so the total is 42", 42.0, True, False),               # right number, no tag: correct, not formatted
    ("<answer>41</answer>", 42.0, False, True),              # formatted but wrong
    ("<answer></answer>", 3.0, False, False),                # empty tag earns nothing
    ("<answer>1,234</answer>", 1234.0, True, True),
    ("<answer>0.5</answer> <answer>0.5</answer>", 0.5, True, False),  # two blocks: not well formed
    ("I don't know", 7.0, False, False),
    ("<answer>-3</answer>", -3.0, True, True),
]


def test_scoring_hand_made_completions():
    texts = [t for t, *_ in HAND_MADE]
    golds = [g for _, g, *_ in HAND_MADE]
    scored = ev.score_completions(texts, [{"gold": g} for g in golds])
    assert [s["correct"] for s in scored] == [c for *_, c, _ in HAND_MADE]
    assert [s["well_formed"] for s in scored] == [w for *_, w in HAND_MADE]
    assert ev.accuracy(scored) == 5 / 8
    assert ev.format_rate(scored) == 4 / 8
    # reward = 1.0 * correct + 0.2 * well formed (the training verifier)
    assert [s["reward"] for s in scored] == pytest.approx([1.2, 1.0, 0.2, 0.0, 1.2, 1.0, 0.0, 1.2])
    assert scored[6]["parsed"] is None and scored[4]["parsed"] == 1234.0


def test_scoring_length_mismatch_and_empty():
    with pytest.raises(ValueError):
        ev.score_completions(["a"], [{"gold": 1.0}, {"gold": 2.0}])
    assert ev.accuracy([]) == 0.0 and ev.format_rate([]) == 0.0


def _row(correct, well_formed, length, truncated, **extra):
    return {"correct": correct, "well_formed": well_formed, "response_length": length,
            "truncated": truncated, **extra}


def test_stage_metrics_values_and_key_order():
    per_task = {
        "gsm8k": [_row(True, True, 10, False), _row(False, True, 20, True), _row(False, False, 30, True)],
        "arith": [_row(True, True, 4, False)],
    }
    m = ev.stage_metrics(per_task)
    assert list(m)[:5] == ["gsm8k_accuracy", "arith_accuracy", "format_rate", "mean_response_length",
                           "truncation_rate"]
    assert m["gsm8k_accuracy"] == pytest.approx(1 / 3) and m["arith_accuracy"] == 1.0
    assert m["format_rate"] == pytest.approx(3 / 4)  # pooled over both tasks
    assert m["mean_response_length"] == pytest.approx(16.0)
    assert m["truncation_rate"] == pytest.approx(0.5)
    assert m["gsm8k_format_rate"] == pytest.approx(2 / 3) and m["gsm8k_examples"] == 3
    assert m["arith_examples"] == 1
    assert (m["gsm8k_accuracy_ci95_low"], m["gsm8k_accuracy_ci95_high"]) == ev.wilson_interval(1, 3)
    assert (m["arith_accuracy_ci95_low"], m["arith_accuracy_ci95_high"]) == ev.wilson_interval(1, 1)
    rounded = ev.round_metrics({"sft": m})
    assert rounded["sft"]["gsm8k_accuracy"] == 0.3333 and isinstance(rounded["sft"]["gsm8k_examples"], int)


def test_stage_metrics_with_sampling_keys():
    rows = [_row(True, True, 5, False, samples_correct=1, pass_at_k=1.0, maj_correct=False),
            _row(False, True, 5, False, samples_correct=0, pass_at_k=0.0, maj_correct=False)]
    m = ev.stage_metrics({"gsm8k": rows, "arith": rows}, samples=4)
    assert m["gsm8k_pass_at_4"] == 0.5 and m["gsm8k_maj_at_4"] == 0.0
    assert m["gsm8k_pass_at_1"] == pytest.approx(1 / 8)
    assert all("@" not in k for k in m)  # MLflow metric names may not contain '@'


# --------------------------------------------------------------------------- intervals

def test_wilson_interval_hand_computed():
    # 7 of 10, z = 1.96: centre (0.7 + 0.19208) / 1.38415 = 0.64450,
    # half 1.96 * sqrt(0.021 + 3.8415 / 400) / 1.38415 = 1.96 * 0.174940 / 1.38415 = 0.24772
    assert ev.wilson_interval(7, 10) == pytest.approx((0.39678, 0.89222), abs=2e-5)
    # 0 of 20 still has width: the upper end is z^2 / (n + z^2) = 3.8415 / 23.8415
    assert ev.wilson_interval(0, 20) == pytest.approx((0.0, 0.16113), abs=1e-4)
    assert ev.wilson_interval(20, 20) == pytest.approx((0.83887, 1.0), abs=1e-4)
    assert ev.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        ev.wilson_interval(3, 2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_interval_contains_the_estimate_and_narrows_with_n(cn):
    c, n = cn
    low, high = ev.wilson_interval(c, n)
    assert 0.0 <= low <= c / n <= high <= 1.0
    low4, high4 = ev.wilson_interval(4 * c, 4 * n)  # the same proportion on 4x the problems
    assert high4 - low4 < high - low


# --------------------------------------------------------------------------- pass@k


def _pass_at_k_closed_form(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _pass_at_k_brute_force(n, c, k):
    """Fraction of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_closed_form_and_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = ev.pass_at_k(n, c, k)
            assert got == pytest.approx(_pass_at_k_closed_form(n, c, k), abs=1e-12)
            assert got == pytest.approx(_pass_at_k_brute_force(n, c, k), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_closed_form_property(nck):
    n, c, k = nck
    got = ev.pass_at_k(n, c, k)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(_pass_at_k_closed_form(n, c, k), abs=1e-9)


def test_pass_at_k_special_cases_and_errors():
    assert ev.pass_at_k(5, 0, 3) == 0.0
    assert ev.pass_at_k(5, 5, 1) == 1.0
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert ev.pass_at_k(4, 1, 4) == 1.0                    # n = k: any sample correct
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError):
            ev.pass_at_k(*bad)


# --------------------------------------------------------------------------- maj@k


def test_majority_vote_tie_broken_by_earliest_first_occurrence():
    assert ev.majority_vote([2.0, 3.0, 3.0, 2.0]) == 2.0
    assert ev.majority_vote([3.0, 2.0, 2.0, 3.0]) == 3.0
    assert ev.majority_vote([None, 7.0, 5.0, None]) == 7.0   # None does not vote; then a 1-1 tie
    assert ev.majority_vote([1.0, 2.0, 2.0]) == 2.0          # a strict majority beats order
    assert ev.majority_vote([5, 5.0, 4.0, 4.0, 4.0]) == 4.0  # 5 and 5.0 are one answer (2 votes < 3)
    assert ev.majority_vote([None, None]) is None and ev.majority_vote([]) is None
    assert ev.majority_vote([float("nan"), 1.0]) == 1.0


def test_maj_correct_and_sample_stats():
    assert ev.maj_correct([1.0, 2.0, 2.0], 2.0) and not ev.maj_correct([1.0, 2.0, 1.0], 2.0)
    assert not ev.maj_correct([None, None], 0.0)
    texts = ["<answer>4</answer>", "<answer>5</answer>", "<answer>5</answer>", "no idea"]
    s = ev.sample_stats(texts, {"gold": 4.0}, k=4)
    assert s == {"samples_correct": 1, "pass_at_k": 1.0, "maj_answer": 5.0, "maj_correct": False}
    text = TaskRewards("t", Checker("text"), ["correct"], [1.0])  # a text task votes on its normalised answers
    s = ev.sample_stats(["<answer>Paris</answer>", "<answer>paris.</answer>", "<answer>Rome</answer>"],
                        {"gold": "Paris"}, k=3, rewards=text)
    assert s == {"samples_correct": 2, "pass_at_k": 1.0, "maj_answer": "paris", "maj_correct": True}


# --------------------------------------------------------------------------- files


def test_failed_write_leaves_previous_file_intact(tmp_path):
    path = tmp_path / "metrics" / "eval.json"
    files.write_json_atomic(path, {"sft": {"gsm8k_accuracy": 0.5}})
    before = path.read_bytes()

    def half_then_fail(f):
        f.write(b'{"sft": {"gsm8k_acc')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, half_then_fail)
    assert path.read_bytes() == before
    with pytest.raises(ValueError):  # NaN is refused before anything is written
        files.write_json_atomic(path, {"sft": {"gsm8k_accuracy": float("nan")}})
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["eval.json"]  # no temporary left behind


def _predictions():
    texts = [t for t, *_ in HAND_MADE]
    golds = [g for _, g, *_ in HAND_MADE]
    return [{"id": f"q{i}", "question": f"question {i}, with \"quotes\"\nand a newline", "gold": g,
             "completion": t, **s, "response_length": len(t), "truncated": i % 3 == 0}
            for i, (t, g, s) in enumerate(zip(texts, golds, ev.score_completions(texts, [{"gold": g} for g in golds])))]


@pytest.mark.slow
def test_outputs_are_byte_identical_on_rerun(tmp_path, monkeypatch):
    from pipeline.stages import evaluate as stage

    monkeypatch.chdir(tmp_path)
    preds = {(s, t): _predictions() for s in ("sft", "grpo") for t in ("gsm8k", "arith")}
    metrics = ev.round_metrics({s: ev.stage_metrics({t: preds[s, t] for t in ("gsm8k", "arith")})
                                for s in ("sft", "grpo")})
    first = stage._write_outputs(metrics, preds)
    snapshot = {k: Path(p).read_bytes() for k, p in first.items()}
    second = stage._write_outputs(metrics, preds)
    assert {k: Path(p).read_bytes() for k, p in second.items()} == snapshot

    data = json.loads(snapshot["eval_json"])
    assert list(data) == ["sft", "grpo"] and data["sft"]["gsm8k_accuracy"] == 0.625
    acc = pd.read_csv(first["accuracy_csv"])
    assert list(acc.columns) == ["stage", "task", "accuracy"] and len(acc) == 4
    back = pd.read_csv(first["predictions_sft_gsm8k"], keep_default_na=False)
    assert back["completion"].tolist() == [t for t, *_ in HAND_MADE]
    assert back["question"][0] == preds["sft", "gsm8k"][0]["question"]
    again = ev.write_figure_atomic(tmp_path / "again.png", ev.accuracy_figure(metrics))
    assert again.read_bytes() == snapshot["accuracy_png"]  # the PNG is the figure checked below


def test_accuracy_figure_draws_the_accuracy_csv():
    """One labelled bar per (stage, task) at the height plots/accuracy.csv gives it."""
    metrics = {"sft": {"gsm8k_accuracy": 0.25, "arith_accuracy": 0.5},
               "grpo": {"gsm8k_accuracy": 0.375, "arith_accuracy": 0.75}}
    ax = ev.accuracy_figure(metrics).axes[0]
    assert ax.get_ylabel() == "greedy accuracy" and ax.get_title() == "Accuracy per stage"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["sft", "grpo"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gsm8k", "arith"]
    bars = {(stage, task): bar.get_height()  # one container per task, its bars in stage order
            for task, container in zip(("gsm8k", "arith"), ax.containers)
            for stage, bar in zip(("sft", "grpo"), container)}
    table = ev.accuracy_table(metrics)
    assert bars == {(r.stage, r.task): r.accuracy for r in table.itertuples()} and len(bars) == 4
    labels = [t.get_text() for t in ax.texts]
    assert sorted(labels) == ["0.25", "0.38", "0.50", "0.75"]


@pytest.mark.slow
def test_training_curves_skip_missing_files_and_empty_cells(tmp_path):
    warm = tmp_path / "warmup.csv"
    warm.write_text("iteration,reward,informative,kl,clipfrac,accuracy\n"
                    "0,0.1,0.5,0.0,0.0,0.2\n1,0.3,0.6,0.01,0.1,\n2,0.5,0.7,0.02,0.1,0.4\n")
    grpo = tmp_path / "grpo.csv"
    grpo.write_text("iteration,reward,kl\n0,0.6,0.0\n1,0.7,0.01\n")
    paths = {"warmup": warm, "grpo": grpo, "missing": tmp_path / "nope.csv"}
    fig = ev.training_curves_figure(paths)
    reward, informative, kl, accuracy = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [title for _, title in ev.CURVE_COLUMNS]
    assert {ax.get_xlabel() for ax in fig.axes} == {"iteration (stages in order)"}

    def series(ax):
        return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}

    # grpo's iterations follow warmup's last (2); a stage without a column draws no line there
    assert series(reward) == {"warmup": ([0, 1, 2], [0.1, 0.3, 0.5]), "grpo": ([3, 4], [0.6, 0.7])}
    assert series(informative) == {"warmup": ([0, 1, 2], [0.5, 0.6, 0.7])}
    assert series(kl) == {"warmup": ([0, 1, 2], [0.0, 0.01, 0.02]), "grpo": ([3, 4], [0.0, 0.01])}
    assert series(accuracy) == {"warmup": ([0, 2], [0.2, 0.4])}  # the empty cell is dropped, not drawn
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["warmup", "grpo"]
    out = ev.plot_training_curves(paths, tmp_path / "curves.png")
    assert out.read_bytes() == ev.write_figure_atomic(tmp_path / "again.png", fig).read_bytes()

    empty = ev.training_curves_figure({"warmup": tmp_path / "nope.csv"})
    assert fig.get_suptitle() == "" and empty.get_suptitle() == "no training curves found"
    assert not any(ax.get_lines() for ax in empty.axes)


def test_training_curves_prefer_the_columns_of_every_sampled_group():
    df = pd.read_csv(io.StringIO("iteration,reward,reward_sampled,informative,informative_sampled,accuracy\n"
                                 "1,0.8,0.9,1.0,0.5,\n2,0.7,,0.9,0.4,0.6\n"))
    name, y = ev.curve_series(df, ev.CURVE_COLUMNS[0][0])
    assert name == "reward_sampled" and y.tolist() == [0.9] and y.index.tolist() == [0]
    assert ev.curve_series(df, ev.CURVE_COLUMNS[1][0])[1].tolist() == [0.5, 0.4]
    old = df.drop(columns=["reward_sampled"])  # a CSV from before the column existed
    assert ev.curve_series(old, ev.CURVE_COLUMNS[0][0])[0] == "reward"
    assert ev.curve_series(df, ("kl",)) is None
    assert ev.curve_series(df, ("accuracy",))[1].index.tolist() == [1]


def test_summary_table_renders_every_stage_and_metric():
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(ev.summary_table({"sft": {"gsm8k_accuracy": 0.25, "gsm8k_examples": 8},
                                    "grpo": {"gsm8k_accuracy": 0.5, "gsm8k_examples": 8}}))
    text = console.export_text()
    for word in ("sft", "grpo", "gsm8k_accuracy", "0.2500", "0.5000", "8"):
        assert word in text


# --------------------------------------------------------------------------- stage


def _write_data(root: Path, n: int = 3) -> None:
    from pipeline.core.config import DEFAULT_TEMPLATE

    (root / "data").mkdir(exist_ok=True)
    for name, source in (("gsm8k_test.jsonl", "gsm8k"), ("arith_eval.jsonl", "arith")):
        with (root / "data" / name).open("w") as f:
            for i in range(n):
                q = f"What is {i} + {i + 1}?"
                f.write(json.dumps({"id": f"{source}-{i}", "source": source, "question": q,
                                    "prompt": DEFAULT_TEMPLATE.format(question=q), "gold": float(2 * i + 1),
                                    "solution": f"<answer>{2 * i + 1}</answer>", "level": 1}) + "\n")


def _quiet_cfg() -> Config:
    cfg = Config()
    cfg.tracking.enabled = False
    return cfg


def test_missing_checkpoint_names_folder_and_stage(tmp_path, monkeypatch):
    from pipeline.stages.evaluate import run_evaluate

    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path)
    cfg = _quiet_cfg()
    cfg.evaluate.stages = ["warmup"]
    with pytest.raises(InputError, match=r"checkpoints/warmup.*'warmup' stage"):
        run_evaluate(cfg)


def test_missing_data_is_an_input_error(tmp_path, monkeypatch):
    from pipeline.stages.evaluate import run_evaluate

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"gsm8k_test.jsonl.*'prepare' stage"):
        run_evaluate(_quiet_cfg())


def test_limit_takes_the_first_rows_in_file_order(tmp_path):
    from pipeline.stages.evaluate import load_rows

    _write_data(tmp_path, n=5)
    rows = load_rows(tmp_path / "data" / "gsm8k_test.jsonl", limit=2)
    assert [r["id"] for r in rows] == ["gsm8k-0", "gsm8k-1"]
    assert len(load_rows(tmp_path / "data" / "gsm8k_test.jsonl", limit=0)) == 5


class _RecordingLogger:
    """A small real fake of `stage_logger(cfg, stage)` that keeps what it is given."""

    def __init__(self):
        self.metrics, self.artifacts, self.tables = {}, [], []

    @contextlib.contextmanager
    def __call__(self, cfg, stage):
        assert stage == "evaluate"
        yield self

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)

    def log_artifact(self, path):
        self.artifacts.append(str(path))

    def log_table(self, rows, name):
        self.tables.append((name, rows))


@pytest.mark.slow
def test_end_to_end_tiny_model_is_deterministic(tmp_path, monkeypatch):
    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.stages.evaluate import eval_jobs, run_evaluate
    from pipeline.train.checkpoint import save_policy

    import torch

    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path, n=3)
    cfg = _quiet_cfg()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size = 1, 2, 32, 128
    cfg.model.device = "cpu"
    cfg.evaluate.batch_size, cfg.evaluate.max_new_tokens, cfg.evaluate.samples = 2, 6, 2
    cfg.evaluate.sample_tasks = ["gsm8k"]  # only GSM8K is sampled: no arith_pass_* keys
    corpus = [json.loads(line)["prompt"] + " <answer>3</answer>"
              for line in (tmp_path / "data" / "gsm8k_test.jsonl").read_text().splitlines()]
    tok = train_tokenizer(corpus * 4, vocab_size=300)
    for i, stage in enumerate(cfg.evaluate.stages):
        torch.manual_seed(i)
        save_policy(tmp_path / "checkpoints" / stage, build_policy(cfg.model, tok))

    logged = _RecordingLogger()
    monkeypatch.setattr("pipeline.stages.evaluate.stage_logger", logged)
    cfg.evaluate.jobs = 1  # the reference: every checkpoint in this process, one after another
    first = run_evaluate(cfg)
    assert logged.metrics["eval/sft/gsm8k_accuracy"] == first["metrics"]["sft"]["gsm8k_accuracy"]
    assert any(p.endswith("eval.json") for p in logged.artifacts) and logged.tables
    outputs = ["metrics/eval.json"] + [f"reports/predictions_{s}_{t}.csv"
                                       for s in cfg.evaluate.stages for t in ("gsm8k", "arith")]
    snapshot = {p: (tmp_path / p).read_bytes() for p in outputs}
    second = run_evaluate(cfg)
    assert {p: (tmp_path / p).read_bytes() for p in outputs} == snapshot
    assert first["metrics"] == second["metrics"]
    # checkpoints scored in spawned processes (evaluate.jobs) give the same bytes as the reference
    cfg.evaluate.jobs = 0
    assert eval_jobs(cfg, 4) == max(1, min(len(os.sched_getaffinity(0)), 4)) and eval_jobs(cfg, 1) == 1
    cfg.evaluate.jobs = 3
    assert eval_jobs(cfg, 4) == 3
    for p in outputs:
        (tmp_path / p).unlink()
    assert run_evaluate(cfg)["metrics"] == first["metrics"]
    assert {p: (tmp_path / p).read_bytes() for p in outputs} == snapshot

    metrics = json.loads(snapshot["metrics/eval.json"])
    assert list(metrics) == ["sft", "control", "warmup", "grpo"]
    for m in metrics.values():
        assert {"gsm8k_accuracy", "arith_accuracy", "format_rate", "gsm8k_pass_at_2", "gsm8k_maj_at_2"} <= set(m)
        assert not any(k.startswith(("arith_pass", "arith_maj")) for k in m)
        assert m["gsm8k_examples"] == 3 and 0 <= m["mean_response_length"] <= 6
    preds = pd.read_csv(tmp_path / "reports/predictions_sft_gsm8k.csv", keep_default_na=False)
    assert {"question", "gold", "completion", "parsed", "reward", "correct"} <= set(preds.columns)
    for name in ("accuracy.png", "training_curves.png", "accuracy.csv"):
        assert (tmp_path / "plots" / name).is_file()

    # a corrupt last checkpoint fails up front, and leaves the previous outputs as they were
    weights = next(p for p in (tmp_path / "checkpoints" / "grpo").iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(InputError, match="grpo"):
        run_evaluate(cfg)
    assert {p: (tmp_path / p).read_bytes() for p in outputs} == snapshot


def test_series_csv_is_one_format_for_every_stage(tmp_path):
    """sft.csv and the GRPO stages' csv come from one writer: header, 6 significant digits (small
    values such as an LR of 3e-7 survive), ints as is, empty cells for missing values."""
    from pipeline.core.files import write_series_csv

    rows = [{"iteration": 1, "lr": 3e-7, "reward": 0.123456789, "accuracy": None},
            {"iteration": 2, "lr": 3e-7, "reward": 1.0, "extra": "ignored"}]
    path = write_series_csv(tmp_path / "s.csv", rows, ["iteration", "lr", "reward", "accuracy"])
    assert path.read_text() == "iteration,lr,reward,accuracy\n1,3e-07,0.123457,\n2,3e-07,1,\n"


def test_sampling_metrics_only_for_the_sampled_tasks():
    sampled = [_row(True, True, 3, False, samples_correct=2, pass_at_k=1.0, maj_correct=True)]
    greedy_only = [_row(False, True, 3, False)]
    m = ev.stage_metrics({"gsm8k": greedy_only, "arith": sampled}, samples={"arith": 4})
    assert m["arith_pass_at_1"] == 0.5 and m["arith_pass_at_4"] == 1.0 and m["arith_maj_at_4"] == 1.0
    assert not any(k.startswith(("gsm8k_pass", "gsm8k_maj")) for k in m)


# --------------------------------------------------------------------------- few-shot baseline, per-level accuracy

def test_entries_put_each_fewshot_entry_after_its_checkpoint():
    cfg = _quiet_cfg()
    cfg.evaluate.stages, cfg.evaluate.fewshot_stages = ["sft", "warmup", "grpo"], ["sft"]
    from pipeline.stages.evaluate import entries

    assert entries(cfg.evaluate) == {"sft": ("sft", False), "sft_fewshot": ("sft", True),
                                     "warmup": ("warmup", False), "grpo": ("grpo", False)}
    cfg.evaluate.stages, cfg.evaluate.fewshot_stages = ["grpo"], ["sft"]  # a few-shot-only checkpoint
    assert entries(cfg.evaluate) == {"grpo": ("grpo", False), "sft_fewshot": ("sft", True)}


def test_fewshot_prompt_as_chat_turns_and_as_text(hf_dirs):
    """Under the chat template each worked example is an earlier user turn (the filled prompt template)
    and its assistant answer, then the question's user turn with the assistant turn opened; without it,
    the examples' prompts and responses as text, a blank line apart, then the question's prompt."""
    from pipeline.data.prompts import fewshot_prompt
    from pipeline.data.tokenizer import load_hf_tokenizer

    cfg = _quiet_cfg()
    cfg.data.prompt_template = "Q: {question}\nUse <answer>N</answer>."
    cfg.data.chat_template, cfg.data.system_prompt = True, "Be brief."
    shots = [("What is 1 + 1?", "1 + 1 = 2.\n<answer>2</answer>"), ("What is 3 - 1?", "<answer>2</answer>")]
    tok = load_hf_tokenizer(hf_dirs["qwen2"])
    eos = tok.hf.eos_token
    assert fewshot_prompt("What is 4 + 4?", shots, tok, cfg.data) == (
        f"<|im_start|>system\nBe brief.{eos}\n"
        f"<|im_start|>user\nQ: What is 1 + 1?\nUse <answer>N</answer>.{eos}\n"
        f"<|im_start|>assistant\n1 + 1 = 2.\n<answer>2</answer>{eos}\n"
        f"<|im_start|>user\nQ: What is 3 - 1?\nUse <answer>N</answer>.{eos}\n"
        f"<|im_start|>assistant\n<answer>2</answer>{eos}\n"
        f"<|im_start|>user\nQ: What is 4 + 4?\nUse <answer>N</answer>.{eos}\n<|im_start|>assistant\n")
    cfg.data.chat_template = False
    assert fewshot_prompt("What is 4 + 4?", shots, None, cfg.data) == (
        "Q: What is 1 + 1?\nUse <answer>N</answer>. 1 + 1 = 2.\n<answer>2</answer>\n\n"
        "Q: What is 3 - 1?\nUse <answer>N</answer>. <answer>2</answer>\n\n"
        "Q: What is 4 + 4?\nUse <answer>N</answer>.")


def test_level_metrics_hand_computed():
    from pipeline.stages.evaluate import level_metrics

    rows = [{"level": lv} for lv in (1, 1, 1, 2, 2, 3)]
    preds = [{"correct": c} for c in (True, True, False, False, False, True)]
    m = level_metrics(rows, preds)
    assert [k for k in m if k.endswith("_accuracy")] == ["arith_level1_accuracy", "arith_level2_accuracy",
                                                          "arith_level3_accuracy"]
    assert (m["arith_level1_accuracy"], m["arith_level2_accuracy"], m["arith_level3_accuracy"]) == (2 / 3, 0.0, 1.0)
    assert (m["arith_level1_examples"], m["arith_level2_examples"], m["arith_level3_examples"]) == (3, 2, 1)
    assert (m["arith_level1_ci95_low"], m["arith_level1_ci95_high"]) == ev.wilson_interval(2, 3)


def test_fewshot_entry_scores_the_checkpoint_on_prompts_with_worked_examples(tmp_path, monkeypatch):
    """A few-shot entry generates from the same checkpoint with the examples before each question: its
    prediction rows are the plain entry's generation on the few-shot prompts (checked against a plain
    reference loop), and the per-level keys appear with evaluate.per_level."""
    import torch

    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.rl.generation import generate
    from pipeline.data.prompts import fewshot_prompt
    from pipeline.stages.evaluate import run_evaluate
    from pipeline.train.checkpoint import load_policy, save_policy

    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path, n=3)
    for name, source in (("gsm8k_train.jsonl", "gsm8k"), ("arith_train.jsonl", "arith")):
        rows = [{"id": f"{source}-t{i}", "source": source, "question": f"What is {i} + 5?", "prompt": "",
                 "gold": float(i + 5), "solution": f"{i} + 5 = {i + 5}.\n<answer>{i + 5}</answer>", "level": 1}
                for i in range(6)]
        (tmp_path / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _quiet_cfg()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size = 1, 2, 32, 1024
    cfg.model.device = "cpu"
    cfg.evaluate.stages, cfg.evaluate.fewshot_stages, cfg.evaluate.fewshot_examples = ["sft"], ["sft"], 2
    cfg.evaluate.batch_size, cfg.evaluate.max_new_tokens, cfg.evaluate.samples, cfg.evaluate.jobs = 2, 5, 0, 1
    cfg.evaluate.per_level = True
    tok = train_tokenizer(["What is 1 + 5? <answer>6</answer> Question: Answer:"] * 8, vocab_size=300)
    torch.manual_seed(0)
    save_policy(tmp_path / "checkpoints" / "sft", build_policy(cfg.model, tok))
    monkeypatch.setattr("pipeline.stages.evaluate.stage_logger", _RecordingLogger())

    metrics = run_evaluate(cfg)["metrics"]
    assert list(metrics) == ["sft", "sft_fewshot"]
    assert metrics["sft_fewshot"]["arith_level1_examples"] == 3
    policy = load_policy(tmp_path / "checkpoints" / "sft")
    shots = [("What is 0 + 5?", "0 + 5 = 5.\n<answer>5</answer>"), ("What is 1 + 5?", "1 + 5 = 6.\n<answer>6</answer>")]
    for task in ("gsm8k", "arith"):
        questions = [f"What is {i} + {i + 1}?" for i in range(3)]
        prompts = [fewshot_prompt(q, shots, policy.tokenizer, cfg.data) for q in questions]
        assert prompts[0].startswith("Solve the problem.") and prompts[0].count("Question:") == 3
        texts = [generate(policy, [p], batch_size=1, max_new_tokens=5)[0][0] for p in prompts]
        preds = pd.read_csv(tmp_path / f"reports/predictions_sft_fewshot_{task}.csv", keep_default_na=False)
        assert list(preds["completion"]) == texts


def _budget_policy(block_size: int):
    import torch

    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.model.policy import build_policy

    cfg = _quiet_cfg()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size = 1, 2, 32, block_size
    cfg.model.device = "cpu"
    tok = train_tokenizer(["What is 1 + 5? <answer>6</answer> Question: Answer: a b c d e f"] * 8, vocab_size=300)
    torch.manual_seed(0)
    return build_policy(cfg.model, tok).eval()


@pytest.mark.parametrize("group_size", [1, 3])
def test_every_row_gets_its_own_budget_whatever_the_batch(group_size):
    """A long prompt no longer shrinks its batch-mates' budget: each row's completions equal those of a
    plain loop generating that row alone with min(max_new_tokens, context - prompt), at any batch size."""
    import torch

    from pipeline.rl.generation import generate, row_budgets
    from pipeline.rl.rollout import rollout_prompts

    policy = _budget_policy(block_size=40)
    prompts = ["What is 1 + 5?", "a " * 36, "Question: What?", "a " * 38, "b c"]
    ids = [policy.tokenizer.encode(p) for p in prompts]
    budgets = row_budgets(policy, ids, 8)
    assert budgets[0] == budgets[2] == budgets[4] == 8 and 0 < budgets[3] < budgets[1] < 8  # two with less room

    reference = []
    for i, b in zip(ids, budgets):  # the plain loop: every row alone with its own budget
        ro = rollout_prompts(policy, None, group_size=group_size, max_new_tokens=b, top_k=0, greedy=True, prompt_ids=[i])
        reference.append((list(ro.texts), ro.response_lengths.tolist(), ro.truncated.tolist()))
    for batch_size in (1, 2, 5):
        texts, lengths, truncated = generate(policy, prompts, batch_size=batch_size, max_new_tokens=8,
                                             group_size=group_size)
        G = group_size
        got = [(texts[j * G:(j + 1) * G], lengths[j * G:(j + 1) * G], truncated[j * G:(j + 1) * G])
               for j in range(len(prompts))]
        assert got == [(t, [int(x) for x in n], [bool(x) for x in r]) for t, n, r in reference], batch_size
        assert all(n <= b for (_, ns, _), b in zip(got, budgets) for n in ns)
    torch.manual_seed(0)


def test_a_question_too_long_for_the_context_is_counted_and_the_rest_scored(tmp_path, monkeypatch, caplog):
    """A 10 KB test question: evaluate scores every other row, counts it (gsm8k_unscorable) and names
    its id, instead of stopping before any checkpoint with a batch range."""
    from pipeline.core.config import DEFAULT_TEMPLATE
    from pipeline.stages.evaluate import run_evaluate
    from pipeline.train.checkpoint import save_policy

    monkeypatch.chdir(tmp_path)
    _write_data(tmp_path, n=3)
    q = "How many? " + "x " * 5000
    with (tmp_path / "data" / "gsm8k_test.jsonl").open("a") as f:
        f.write(json.dumps({"id": "gsm8k-long", "source": "gsm8k", "question": q, "gold": 1.0, "level": 1,
                            "prompt": DEFAULT_TEMPLATE.format(question=q), "solution": "<answer>1</answer>"}) + "\n")
    cfg = _quiet_cfg()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size = 1, 2, 32, 128
    cfg.model.device = "cpu"
    cfg.evaluate.stages, cfg.evaluate.batch_size, cfg.evaluate.max_new_tokens = ["sft"], 4, 5
    cfg.evaluate.samples, cfg.evaluate.jobs = 0, 1
    save_policy(tmp_path / "checkpoints" / "sft", _budget_policy(block_size=128))
    monkeypatch.setattr("pipeline.stages.evaluate.stage_logger", _RecordingLogger())
    with caplog.at_level("WARNING"):
        metrics = run_evaluate(cfg)["metrics"]["sft"]
    assert metrics["gsm8k_unscorable"] == 1 and metrics["gsm8k_examples"] == 3 and "arith_unscorable" not in metrics
    assert "gsm8k-long" in caplog.text and "1 of 4 rows" in caplog.text
    preds = pd.read_csv(tmp_path / "reports/predictions_sft_gsm8k.csv", keep_default_na=False)
    assert list(preds["id"]) == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]


def test_the_accuracy_plots_carry_a_bar_per_curriculum_level_when_it_was_scored():
    """With `evaluate.per_level` (the default) plots/accuracy.csv and .png hold each level of the held-out
    arithmetic after the tasks, in level order (level 10 after level 2), at the heights eval.json gives."""
    metrics = {"sft": {"gsm8k_accuracy": 0.25, "arith_accuracy": 0.5, "arith_level2_accuracy": 0.4,
                       "arith_level1_accuracy": 0.6, "arith_level10_accuracy": 0.1, "arith_level1_ci95_low": 0.3},
               "warmup": {"gsm8k_accuracy": 0.375, "arith_accuracy": 0.75, "arith_level1_accuracy": 0.9,
                          "arith_level2_accuracy": 0.6, "arith_level10_accuracy": 0.2}}
    assert ev.plotted_tasks(metrics) == ("gsm8k", "arith", "arith_level1", "arith_level2", "arith_level10")
    table = ev.accuracy_table(metrics)
    assert [(r.stage, r.task, r.accuracy) for r in table.itertuples()][2:5] == [
        ("sft", "arith_level1", 0.6), ("sft", "arith_level2", 0.4), ("sft", "arith_level10", 0.1)]
    ax = ev.accuracy_figure(metrics).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(ev.plotted_tasks(metrics))
    bars = {(stage, task): bar.get_height() for task, container in zip(ev.plotted_tasks(metrics), ax.containers)
            for stage, bar in zip(("sft", "warmup"), container)}
    assert bars == {(r.stage, r.task): r.accuracy for r in table.itertuples()} and len(bars) == 10
