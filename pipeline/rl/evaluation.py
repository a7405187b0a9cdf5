"""Evaluation metrics and reports: pure functions, no model and no generation.

The evaluate stage (``pipeline/stages/evaluate.py``) generates completions; everything here works on
plain lists of completions, golds and per-example rows, so a hand-made list checks every number.

Metrics
- accuracy: fraction of greedy completions whose parsed answer matches the gold, judged by the
  same verifier as training (``pipeline.rewards``); ``accuracy_ci95_low/high`` is its 95% Wilson
  score interval over the evaluated problems (the uncertainty of a finite test set, not of seeds).
- format rate: fraction with a well-formed ``<answer>N</answer>``.
- pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", eq. 1): with n samples of which c are correct, ``1 - C(n-c, k) / C(n, k)``, averaged over
  problems. With n = k (the evaluate stage's setting) it is simply "any of the k samples correct".
- maj@k: majority vote over the parsed answers of k samples; unparseable samples do not vote.
  Ties are broken by the earliest first occurrence (the answer that appeared first in sample order
  wins), so the vote is deterministic and does not depend on dict or float ordering.

Files are written atomically (temporary file in the same folder, then ``os.replace``): a reader
never sees a partial ``eval.json``, CSV or PNG, and a failure leaves the previous file intact.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.files import write_bytes_atomic
from pipeline.rewards.task_rewards import NUMBER_REWARDS, TaskRewards
from pipeline.rewards.verifiers import answers_match

DECIMALS = 4
TASKS = ("gsm8k", "arith")


# --------------------------------------------------------------------------- scoring

def score_completions(texts: Sequence[str], rows: Sequence[Mapping[str, Any]],
                      rewards: TaskRewards | None = None) -> list[dict[str, Any]]:
    """Parsed answer, reward, correctness and format of each completion (text i answers rows[i]), judged
    by the task's checker and rewards exactly as in training (default: a number task's, gsm8k and arith)."""
    if len(texts) != len(rows):
        raise ValueError(f"{len(texts)} completions but {len(rows)} rows")
    rewards = rewards or NUMBER_REWARDS
    checker = rewards.checker
    totals, _ = rewards.score([r.get("prompt", "") for r in rows], list(texts), list(rows)) if rows else ([], {})
    return [{"parsed": checker.parsed(t), "reward": float(total), "correct": checker.correct(t, r),
             "well_formed": checker.well_formed(t)} for t, r, total in zip(texts, rows, totals)]


def mean(values: Iterable[float | bool]) -> float:
    """Mean of a possibly empty sequence; 0.0 when empty (so metrics files never hold NaN)."""
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


def accuracy(scored: Sequence[Mapping[str, Any]]) -> float:
    return mean(r["correct"] for r in scored)


def format_rate(scored: Sequence[Mapping[str, Any]]) -> float:
    return mean(r["well_formed"] for r in scored)


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default): `correct` of `n`.

    Unlike the normal approximation it stays inside [0, 1] and keeps its coverage near 0 and 1
    (a checkpoint at 0% or 100% still gets an interval of non-zero width). n = 0: (0, 1).
    """
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval needs 0 <= correct <= n; got correct={correct}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p, z2 = correct / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # at c = 0 and c = n the interval ends exactly at 0 and 1 (float rounding would miss by an ulp)
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == n else min(1.0, centre + half)
    return low, high


# --------------------------------------------------------------------------- sampling metrics

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as 1 - prod_{i<k} (n-c-i)/(n-i), which avoids huge binomials.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _vote(answer: Any) -> Any:
    """What a vote counts: a number as a float (3 and 3.0, -0.0 and 0.0 are one vote), text as it is."""
    return float(answer) if isinstance(answer, (int, float)) else answer


def majority_vote(answers: Sequence[float | None]) -> float | None:
    """The most frequent parsed answer; None (or NaN) does not vote; ties -> earliest first occurrence.

    Returns None when no sample has a parsable answer.
    """
    counts: dict[float, int] = {}
    first: dict[float, int] = {}
    for i, a in enumerate(answers):
        if a is None or (isinstance(a, float) and math.isnan(a)):
            continue
        key = _vote(a)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    return min(counts, key=lambda a: (-counts[a], first[a]))


def maj_correct(answers: Sequence[Any], gold: float) -> bool:
    """Whether the majority answer of a number task's samples equals the gold."""
    winner = majority_vote(answers)
    return winner is not None and bool(answers_match(winner, gold))


def sample_stats(texts: Sequence[str], row: Mapping[str, Any], k: int,
                 rewards: TaskRewards | None = None) -> dict[str, Any]:
    """Per-problem sampling figures from its n sampled completions (pass@k with k <= n); the majority
    answer is correct when a sample giving it is."""
    scored = score_completions(texts, [row] * len(texts), rewards)
    c = sum(r["correct"] for r in scored)
    winner = majority_vote([r["parsed"] for r in scored])
    return {
        "samples_correct": c,
        "pass_at_k": pass_at_k(len(texts), c, k),
        "maj_answer": winner,
        "maj_correct": any(r["correct"] for r in scored if r["parsed"] is not None and _vote(r["parsed"]) == _vote(winner)),
    }


# --------------------------------------------------------------------------- metrics dicts

def task_metrics(rows: Sequence[Mapping[str, Any]], samples: int = 0) -> dict[str, float | int]:
    """Metrics of one (stage, task) from its per-example prediction rows."""
    low, high = wilson_interval(sum(bool(r["correct"]) for r in rows), len(rows))
    out: dict[str, float | int] = {
        "accuracy": accuracy(rows),
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "format_rate": format_rate(rows),
        "mean_response_length": mean(r["response_length"] for r in rows),
        "truncation_rate": mean(r["truncated"] for r in rows),
        "examples": len(rows),
    }
    if samples > 0:
        if samples > 1:
            out["pass_at_1"] = mean(r["samples_correct"] / samples for r in rows)
        out[f"pass_at_{samples}"] = mean(r["pass_at_k"] for r in rows)
        out[f"maj_at_{samples}"] = mean(r["maj_correct"] for r in rows)
    return out


def stage_metrics(per_task: Mapping[str, Sequence[Mapping[str, Any]]],
                  samples: int | Mapping[str, int] = 0) -> dict[str, float | int]:
    """One stage's flat metrics in a fixed key order; headline keys first.

    ``{task}_accuracy`` for each task, then pooled ``format_rate``, ``mean_response_length`` and
    ``truncation_rate`` over every evaluated example, then per-task details. `samples`: k for every
    task, or per task (a task not in the mapping was not sampled).
    """
    tasks = [t for t in TASKS if t in per_task] + [t for t in per_task if t not in TASKS]
    k = {t: samples.get(t, 0) if isinstance(samples, Mapping) else samples for t in tasks}
    each = {t: task_metrics(per_task[t], k[t]) for t in tasks}
    pooled = [r for t in tasks for r in per_task[t]]
    out: dict[str, float | int] = {f"{t}_accuracy": each[t]["accuracy"] for t in tasks}
    out["format_rate"] = format_rate(pooled)
    out["mean_response_length"] = mean(r["response_length"] for r in pooled)
    out["truncation_rate"] = mean(r["truncated"] for r in pooled)
    for t in tasks:
        for key, value in each[t].items():
            if key != "accuracy":
                out[f"{t}_{key}"] = value
    return out


def round_metrics(metrics: Mapping[str, Mapping[str, float | int]], decimals: int = DECIMALS) -> dict:
    """`{stage: {metric: value}}` with floats rounded (ints kept), key order preserved."""
    return {
        stage: {k: (v if isinstance(v, int) and not isinstance(v, bool) else round(float(v), decimals))
                for k, v in values.items()}
        for stage, values in metrics.items()
    }


def plotted_tasks(metrics: Mapping[str, Mapping[str, float]], tasks: Sequence[str] = TASKS) -> tuple[str, ...]:
    """`tasks`, then the held-out arithmetic of each curriculum level the metrics hold (``arith_level<n>``,
    scored with ``evaluate.per_level``), in level order."""
    levels = {int(m.group(1)) for values in metrics.values() for key in values
              if (m := re.fullmatch(r"arith_level(\d+)_accuracy", key))}
    return (*tasks, *(f"arith_level{n}" for n in sorted(levels)))


def accuracy_table(metrics: Mapping[str, Mapping[str, float]], tasks: Sequence[str] = TASKS):
    """Long-format DataFrame (stage, task, accuracy) for `dvc plots` and the bar chart: each task, then
    the held-out arithmetic per level where it was scored (a panel each in `dvc plots`)."""
    import pandas as pd

    tasks = plotted_tasks(metrics, tasks)
    rows = [{"stage": s, "task": t, "accuracy": m[f"{t}_accuracy"]}
            for s, m in metrics.items() for t in tasks if f"{t}_accuracy" in m]
    return pd.DataFrame(rows, columns=["stage", "task", "accuracy"])


# --------------------------------------------------------------------------- figures

def write_figure_atomic(path: str | Path, fig) -> Path:
    buf = io.BytesIO()
    # no "Software" stamp: the PNG bytes depend only on the data and the matplotlib renderer
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return write_bytes_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------- plots

def _figure(width: float, height: float, nrows: int = 1, ncols: int = 1):
    """A figure on the Agg canvas without touching pyplot's global state or backend."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def plot_accuracy(metrics: Mapping[str, Mapping[str, float]], path: str | Path,
                  tasks: Sequence[str] = TASKS) -> Path:
    """plots/accuracy.png: :func:`accuracy_figure` written atomically."""
    return write_figure_atomic(path, accuracy_figure(metrics, tasks))


def accuracy_figure(metrics: Mapping[str, Mapping[str, float]], tasks: Sequence[str] = TASKS):
    """Grouped bar chart: one group per stage, one bar per task (and per arithmetic level, where scored)."""
    stages = list(metrics)
    tasks = plotted_tasks(metrics, tasks)
    fig, axes = _figure(6.0 if len(tasks) <= 2 else 8.0, 4.0)
    ax = axes[0][0]
    width = 0.8 / max(len(tasks), 1)
    for j, task in enumerate(tasks):
        xs = [i + (j - (len(tasks) - 1) / 2) * width for i in range(len(stages))]
        ys = [float(metrics[s].get(f"{task}_accuracy", 0.0)) for s in stages]
        bars = ax.bar(xs, ys, width, label=task)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(stages)), stages)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("greedy accuracy")
    ax.set_title("Accuracy per stage")
    ax.legend()
    return fig


# (CSV columns in order of preference, title): the *_sampled columns count every group rolled out,
# including those dynamic sampling dropped, so they are the policy's own figures; older CSVs lack them
CURVE_COLUMNS = ((("reward_sampled", "reward"), "mean reward (all rollouts)"),
                 (("informative_sampled", "informative"), "informative fraction (all groups)"),
                 (("kl",), "KL to reference"), (("accuracy",), "held-out accuracy"))


def curve_series(df, cols: tuple[str, ...]):
    """The first of `cols` that `df` has with at least one numeric cell: (name, values without the
    empty cells), or None."""
    import pandas as pd

    for col in cols:
        if col in df.columns:
            y = pd.to_numeric(df[col], errors="coerce")
            if y.notna().any():
                return col, y[y.notna()]
    return None


def plot_training_curves(csv_paths: Mapping[str, str | Path], path: str | Path) -> Path:
    """plots/training_curves.png: :func:`training_curves_figure` written atomically."""
    return write_figure_atomic(path, training_curves_figure(csv_paths))


def training_curves_figure(csv_paths: Mapping[str, str | Path]):
    """Reward, informative, KL and accuracy against iteration, one line per stage CSV.

    Stages run one after another, so each later stage's iterations are shifted to start after the
    previous one's last. Missing files and missing columns are skipped; empty cells (accuracy on
    iterations without an eval) are dropped rather than drawn as gaps.
    """
    import pandas as pd

    fig, axes = _figure(10.0, 6.5, 2, 2)
    offset = 0
    plotted = False
    for stage, csv in csv_paths.items():
        csv = Path(csv)
        if not csv.is_file():
            continue
        df = pd.read_csv(csv)
        if "iteration" not in df.columns or df.empty:
            continue
        x = df["iteration"] + offset
        for ax, (cols, _) in zip(axes.flat, CURVE_COLUMNS):
            found = curve_series(df, cols)
            if found is not None:
                y = found[1]
                ax.plot(x[y.index], y, marker="." if len(y) < 30 else None, label=stage)
                plotted = True
        offset = int(x.max()) + 1
    for ax, (_, title) in zip(axes.flat, CURVE_COLUMNS):
        ax.set_title(title)
        ax.set_xlabel("iteration (stages in order)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if not plotted:
        fig.suptitle("no training curves found")
    return fig


# --------------------------------------------------------------------------- terminal table

def summary_table(metrics: Mapping[str, Mapping[str, float | int]], title: str = "Evaluation"):
    """A rich Table: one row per metric, one column per stage (narrow enough for a terminal)."""
    from rich.table import Table

    stages = list(metrics)
    keys: list[str] = []
    for values in metrics.values():
        keys += [k for k in values if k not in keys]
    table = Table(title=title)
    table.add_column("metric")
    for s in stages:
        table.add_column(s, justify="right")
    for k in keys:
        cells = []
        for s in stages:
            v = metrics[s].get(k)
            cells.append("" if v is None else (str(v) if isinstance(v, int) else f"{v:.4f}"))
        table.add_row(k, *cells)
    return table


# --------------------------------------------------------------------------- training summary

TRAIN_SIGNALS = ("reward", "kl", "informative", "clipfrac")


def training_summary(csv_path: str | Path) -> dict[str, float | int]:
    """Final and mean of each GRPO signal in a stage's per-iteration CSV (``plots/<stage>.csv``):
    ``{"iterations": n, "reward_final": .., "reward_mean": .., "kl_final": .., ...}``; empty cells
    are skipped, a missing file or column gives no entry. The figures DVC ranks experiments by."""
    import pandas as pd

    csv_path = Path(csv_path)
    if not csv_path.is_file() or csv_path.stat().st_size == 0:
        return {}
    df = pd.read_csv(csv_path)
    out: dict[str, float | int] = {"iterations": int(len(df))}
    for col in TRAIN_SIGNALS:
        if col in df:
            values = pd.to_numeric(df[col], errors="coerce").dropna()
            if len(values):
                out[f"{col}_final"] = round(float(values.iloc[-1]), 4)
                out[f"{col}_mean"] = round(float(values.mean()), 4)
    return out
