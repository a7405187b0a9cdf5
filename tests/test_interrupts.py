"""A stage stopped by a signal, as systemd, Docker or a flow stopping its stages sends it: the real
grpo stage through the CLI, SIGTERM while it trains. It stops within seconds with one line (no
traceback), its MLflow run ends KILLED, its resume state stays, and a plain re-run resumes from it
and ends bit-identical to a run never stopped. (The flow's side: tests/test_integration_servers.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import GSM8K, QUIET_ENV, REPO, weights

pytestmark = pytest.mark.slow

OVERRIDES = ("grpo.iterations=6", "grpo.save_every=2", "grpo.eval_every=0", "tracking.enabled=true",
             "tracking.experiment=interrupts")


def grpo_cli(cwd: Path, db: Path) -> list[str]:
    sets = [*OVERRIDES, f"data.gsm8k_source={GSM8K}", f"tracking.uri=sqlite:///{db}"]
    return [sys.executable, "-m", "pipeline", "grpo", "--params", str(REPO / "configs" / "smoke.yaml"),
            *[x for s in sets for x in ("--set", s)]]


def cli_env() -> dict[str, str]:
    # one intra-op thread: bit-exactness across processes holds for a fixed thread count
    return {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_sigterm_stops_a_stage_in_one_line_keeps_its_resume_state_and_the_rerun_is_bit_identical(
        grpo_workdir, tmp_path):
    from mlflow.tracking import MlflowClient

    reference = tmp_path / "never-stopped"
    shutil.copytree(grpo_workdir, reference)
    done = subprocess.run(grpo_cli(reference, tmp_path / "ref.db"), cwd=reference, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    db = tmp_path / "mlflow.db"
    proc = subprocess.Popen(grpo_cli(grpo_workdir, db), cwd=grpo_workdir, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    resume = grpo_workdir / "checkpoints" / "grpo.resume"
    deadline = time.monotonic() + 300
    while not (resume / "step_000002").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - t0
    print(f"the grpo stage exited {seconds:.1f} s after SIGTERM")
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert seconds < 20 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIGTERM: grpo stopped; resume state kept in checkpoints/grpo.resume"), last
    assert "run the same command again to resume" in last
    assert (resume / "step_000002").is_dir() and not (grpo_workdir / "checkpoints" / "grpo").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("interrupts").experiment_id])
    assert run.info.status == "KILLED"

    rerun = subprocess.run(grpo_cli(grpo_workdir, db), cwd=grpo_workdir, env=cli_env(), capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0 and "resuming from" in rerun.stderr, rerun.stderr[-3000:]
    a, b = weights(reference / "checkpoints" / "grpo"), weights(grpo_workdir / "checkpoints" / "grpo")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
