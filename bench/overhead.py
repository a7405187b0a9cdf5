"""Orchestration overhead: the smoke pipeline run directly, as the Prefect flow, and by `dvc repro`;
and MLflow tracking on vs off.

Each way runs in its own fresh copy of the repo (tracked + untracked-not-ignored files, a git repo
for DVC) with configs/smoke.yaml (GSM8K: the local copy) written out as params.yaml, as a
subprocess timed end to end (interpreter start and imports included, as a user would see):

- direct:   one Python process calling the five stage functions in order (``python -m pipeline all``)
- prefect:  ``python -m flows.grpo_pipeline`` (one task per stage; temporary local Prefect API)
- dvc:      ``dvc repro`` (one ``python -m pipeline STAGE`` process per stage, plus DVC's hashing/lock)
- mlflow:   direct with ``tracking.enabled=true`` (sqlite:///mlflow.db in the copy)

Overhead = way - direct, in seconds and as a fraction of direct. The ways alternate round by round
(``--repeats``); every child gets OMP_NUM_THREADS=1. The smoke stages take seconds, so these
fractions are an upper bound for a real run: the overhead is a roughly fixed number of seconds per
run (per stage for DVC), which the default run's minutes dilute; see docs/results/speed.md.

    .venv/bin/python bench/overhead.py [--repeats 1] [--gsm8k PATH] [--ways direct,prefect,dvc,mlflow]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GIT_ENV, copy_repo, default_gsm8k, emit, load_avg, median

BIN = Path(sys.executable).parent
COMMANDS = {
    "direct": [sys.executable, "-m", "pipeline", "all"],
    "prefect": [sys.executable, "-m", "flows.grpo_pipeline"],
    "dvc": [sys.executable, "-m", "dvc", "repro"],
    "mlflow": [sys.executable, "-m", "pipeline", "all", "--set", "tracking.enabled=true"],
}


def run_way(way: str, gsm8k: str) -> float:
    with tempfile.TemporaryDirectory(prefix=f"grpo-overhead-{way}-") as tmp:
        repo = copy_repo(Path(tmp), gsm8k)
        env = {**os.environ, **GIT_ENV, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(repo),
               "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop("PREFECT_API_URL", None)
        t0 = time.perf_counter()
        proc = subprocess.run(COMMANDS[way], cwd=repo, env=env, capture_output=True, text=True, check=False,
                              timeout=1800)
        secs = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{way} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gsm8k", default=None)
    ap.add_argument("--ways", default="direct,prefect,dvc,mlflow")
    args = ap.parse_args()
    gsm8k = args.gsm8k or default_gsm8k()
    ways = args.ways.split(",")
    if "direct" not in ways:
        ways.insert(0, "direct")
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats):
        order = ways if r % 2 == 0 else ways[::-1]  # alternate the order too
        for way in order:
            times[way].append(run_way(way, gsm8k))
            print(f"  round {r + 1}: {way:8s} {times[way][-1]:7.1f}s", flush=True)
    sec = {w: median(v) for w, v in times.items()}
    base = sec["direct"]
    print(f"load {load_avg()}; smoke pipeline (configs/smoke.yaml), median of {args.repeats}")
    print(f"{'way':8s} {'s':>8s} {'overhead s':>11s} {'fraction':>9s}")
    for w in ways:
        print(f"{w:8s} {sec[w]:8.1f} {sec[w] - base:11.1f} {(sec[w] - base) / base:9.1%}")
    emit({"bench": "overhead", "repeats": args.repeats, "seconds": {w: round(s, 2) for w, s in sec.items()},
          "overhead_s": {w: round(sec[w] - base, 2) for w in ways if w != "direct"},
          "overhead_fraction": {w: round((sec[w] - base) / base, 4) for w in ways if w != "direct"},
          "times": {w: [round(t, 2) for t in v] for w, v in times.items()}})


if __name__ == "__main__":
    main()
