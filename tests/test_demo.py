"""`make demo`: the first look at GRPO learning (configs/demo.yaml through the Prefect flow, tracking on).

Whether its reward and held-out accuracy rise is a measurement of the whole run (minutes; the figures
are in docs/results/demo.md), not a test. What is tested: the target runs the flow on that config,
the config keeps tracking on and curves to look at, and the flow on it, cut to a few steps, is a DVC
experiment whose warmup run in MLflow holds a reward per iteration and an accuracy per check, and
whose output ends by saying where to look.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUIET_ENV, REPO, copy_repo


def test_make_demo_runs_the_flow_on_the_demo_config():
    out = subprocess.run(["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-m flows.grpo_pipeline" in out and "--params configs/demo.yaml" in out


def test_the_demo_config_tracks_and_has_curves_to_look_at():
    from pipeline.core.config_loading import load_config

    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.tracking.enabled and cfg.tracking.experiment == "grpo-demo"
    w = cfg.warmup
    assert w.log_every == 1 and w.iterations >= 5 * w.eval_every > 0  # a reward per iteration, 5+ accuracy checks
    assert cfg.evaluate.per_level and cfg.data.arith_max_level <= 2  # levels a 2-layer GPT learns in minutes


@pytest.mark.slow
def test_the_demo_through_the_flow_logs_its_curves_and_says_where_to_look(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    cut = ["sft.steps=40", "sft.eval_every=20", "warmup.iterations=4", "warmup.eval_every=2", "control.steps=4",
           "control.eval_every=4", "data.arith_train_size=400", "evaluate.gsm8k_limit=4", "evaluate.arith_limit=8"]
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [a for c in cut for a in ("--set", c)]
    proc = subprocess.run([sys.executable, "-m", "flows.grpo_pipeline", "--params", "configs/demo.yaml", *args],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"mlflow ui --backend-store-uri sqlite:///{repo}/mlflow.db" in out and "experiment 'grpo-demo'" in out
    assert "prefect server start --host 127.0.0.1" in out

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("grpo-demo")
    [warmup] = client.search_runs([exp.experiment_id], "tags.stage = 'warmup'")
    rewards = client.get_metric_history(warmup.info.run_id, "warmup/reward_sampled")
    assert [m.step for m in rewards] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(warmup.info.run_id, "warmup/accuracy")] == [2, 4]
    listed = json.loads(subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=repo, env=env,
                                       capture_output=True, text=True, check=True).stdout)
    [experiment] = [e for row in listed for e in row.get("experiments") or []]  # the demo, saved by DVC
    assert subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout == ""
