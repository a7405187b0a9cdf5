"""Real servers on 127.0.0.1 (free ports, temporary homes), always stopped by their fixtures:

- a Prefect server + `python -m flows.serve` (cron deployment), a run triggered with run_deployment;
- an MLflow server the smoke pipeline logs to; metric histories read back with MlflowClient, and
  fail-fast when the server is gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.config import STAGES
from tests.conftest import QUIET_ENV, copy_repo, task_runs_of

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """A child in its own process group (so stop() ends it and whatever it spawned)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


def base_env(repo: Path) -> dict[str, str]:
    return {**os.environ, **QUIET_ENV, "PYTHONPATH": str(repo),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


# --------------------------------------------------------------------------- Prefect

@pytest.fixture
def prefect_server(tmp_path):
    port = free_port()
    home = tmp_path / "prefect_home"
    home.mkdir()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": url,
           "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_KEY", None)
    log = tmp_path / "prefect_server.log"
    proc = start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 tmp_path, env, log)
    try:
        wait_http(f"{url}/health", proc, log)
        yield {"url": url, "env": env}
    finally:
        stop(proc)


@pytest.mark.slow
def test_served_deployment_runs_on_trigger(tmp_path, prefect_server):
    """A triggered run with an override is a DVC experiment: the workspace's params and outputs stay
    as they were, `dvc status` is clean, `dvc exp show` lists it; the deployment holds limit 1."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.conftest import experiment, sh

    repo = copy_repo(tmp_path / "repo")
    sh(repo, "dvc", "repro")
    before = {p: (repo / p).read_bytes() for p in ("params.yaml", "dvc.lock", "metrics/eval.json",
                                                   "checkpoints/grpo/model.safetensors")}
    env = {**base_env(repo), **prefect_server["env"]}
    log = tmp_path / "serve.log"
    serve = start([sys.executable, "-m", "flows.serve", "--name", "itest", "--cron", "0 3 * * *",
                   "--params", "params.yaml"], repo, env, log)
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
            from prefect.client.orchestration import get_client

            deployment = None
            deadline = time.monotonic() + 60
            with get_client(sync_client=True) as client:
                while deployment is None:
                    assert serve.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    try:
                        deployment = client.read_deployment_by_name("grpo-pipeline/itest")
                    except Exception:  # not registered yet
                        time.sleep(0.5)
            crons = [getattr(s.schedule, "cron", None) for s in deployment.schedules]
            assert crons == ["0 3 * * *"] and deployment.parameters["params_path"] == "params.yaml"
            assert deployment.global_concurrency_limit.limit == 1  # held by the server, not the process
            flow_run = run_deployment("grpo-pipeline/itest", parameters={"overrides": ["grpo.kl_coef=0.02"]},
                                      timeout=600, poll_interval=2)
            assert flow_run.state.is_completed(), (flow_run.state, log.read_text()[-4000:])
            runs = task_runs_of(flow_run.id, expect=STAGES)
            for stage in STAGES:
                mine = [r for r in runs if r.name.rsplit("-", 1)[0] == stage]
                assert len(mine) == 1 and mine[0].state.is_completed(), (stage, runs)
        assert {p: (repo / p).read_bytes() for p in before} == before  # the workspace as it was found
        assert "up to date" in sh(repo, "dvc", "status")
        data = experiment(repo, flow_run.name)
        assert data["params"]["params.yaml"]["data"]["grpo"]["kl_coef"] == 0.02
        assert "grpo" in data["metrics"]["metrics/train.json"]["data"]
    finally:
        stop(serve)


# --------------------------------------------------------------------------- MLflow

@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    home = tmp_path / "mlflow_home"
    home.mkdir()
    log = tmp_path / "mlflow_server.log"
    proc = start([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                  "--backend-store-uri", f"sqlite:///{home / 'tmp.db'}",
                  "--artifacts-destination", str(home / "artifacts")],
                 home, {**os.environ, **QUIET_ENV}, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def test_smoke_pipeline_logs_to_mlflow_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    repo = copy_repo(tmp_path / "repo", git=False)
    env = base_env(repo)
    env.pop("MLFLOW_TRACKING_URI", None)
    track = ["--set", "tracking.enabled=true", "--set", f"tracking.uri={mlflow_server}",
             "--set", "tracking.experiment=itest"]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "all", *track], cwd=repo, env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"smoke pipeline against the MLflow server: {time.monotonic() - t0:.0f} s")

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("itest")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("grpo.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    stages = {r.data.tags["grpo.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert {"prepare", "sft", "warmup", "control", "grpo", "evaluate"} <= set(stages)
    grpo = stages["grpo"]
    history = client.get_metric_history(grpo.info.run_id, "grpo/reward")
    steps = [m.step for m in history]  # one point per iteration, stepped by iteration
    assert len(steps) == 2 and steps == sorted(set(steps))
    assert grpo.data.params["grpo.kl_coef"] and grpo.data.tags["grpo.stage"] == "grpo"
    assert any(k.startswith("eval/") for k in stages["evaluate"].data.metrics)
    assert client.list_artifacts(stages["evaluate"].info.run_id)

    # compare: the CLI table reads the same server
    cmp = subprocess.run([sys.executable, "-m", "pipeline", "compare", *track], cwd=repo, env=env,
                         capture_output=True, text=True, check=False, timeout=120)
    assert cmp.returncode == 0 and "grpo/reward" in cmp.stdout, cmp.stderr[-2000:]

    # the server gone: a training stage fails before training (no iteration logged, no resume
    # state written) and keeps its outputs
    outputs = ("checkpoints/grpo/model.safetensors", "plots/grpo.csv")
    before = {p: (repo / p).read_bytes() for p in outputs}
    down = f"http://127.0.0.1:{free_port()}"
    fail = subprocess.run([sys.executable, "-m", "pipeline", "grpo", "--set", "tracking.enabled=true",
                           "--set", f"tracking.uri={down}", "--set", "grpo.kl_coef=0.03"],
                          cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert fail.returncode == 2, fail.stderr[-2000:]
    assert down in fail.stderr and "tracking.enabled=false" in fail.stderr
    assert {p: (repo / p).read_bytes() for p in outputs} == before
    assert not (repo / "checkpoints" / "grpo.resume").exists()
    print(json.dumps({"runs": len(runs)}))
