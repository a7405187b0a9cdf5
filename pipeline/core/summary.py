"""The headline numbers of the last run in a workspace, as a short table (what ``make run`` ends with).

Reads only the pipeline's own metric files: ``metrics/train.json`` (each training stage's final
reward, KL and informative fraction) and ``metrics/eval.json`` (accuracy per checkpoint and task).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.config import METRICS_DIR

TRAIN_COLUMNS = (("reward_final", "reward"), ("kl_final", "kl"), ("informative_final", "informative"))
EVAL_COLUMNS = (("gsm8k_accuracy", "gsm8k acc"), ("arith_accuracy", "arith acc"))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def headline_table(root: str | Path = ".") -> str:
    """One row per checkpoint (sft, control, warmup, grpo): final training signals and evaluation accuracy."""
    train = _read(Path(root) / METRICS_DIR / "train.json")
    evals = _read(Path(root) / METRICS_DIR / "eval.json")
    stages = list(dict.fromkeys([*evals, *train]))
    if not stages:
        return f"no metrics yet in {Path(root) / METRICS_DIR}"
    header = ["stage", *(h for _, h in TRAIN_COLUMNS), *(h for _, h in EVAL_COLUMNS)]
    rows = [[s, *(_cell(train.get(s, {}).get(k)) for k, _ in TRAIN_COLUMNS),
             *(_cell(evals.get(s, {}).get(k)) for k, _ in EVAL_COLUMNS)] for s in stages]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
