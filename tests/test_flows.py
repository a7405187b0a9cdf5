"""Prefect tasks and flows: unit tests call `task.fn`; flows run under `prefect_test_harness`.

The end-to-end test runs the real smoke pipeline through the flow in a temporary copy of the repo
and checks one task run per stage, the evaluation artifact, the MLflow nesting, and that the flow
writes the same files as the CLI/DVC stages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.config import STAGES
from tests.conftest import copy_repo, output_files, smoke_outputs, task_runs_of


def settled_state(state, timeout: float = 60.0):
    """The flow run's final state as the API records it (under load the returned state can lag)."""
    import time

    from prefect.client.orchestration import get_client

    if state.is_final():
        return state
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            current = client.read_flow_run(state.state_details.flow_run_id).state
            if current.is_final() or time.monotonic() > deadline:
                return current
            time.sleep(0.5)


def artifacts_of(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


# --------------------------------------------------------------------------- unit: retry conditions and task.fn

def _failed(exc):
    from prefect.states import Failed

    return Failed(data=exc)


def test_retry_conditions_retry_only_transient_failures():
    from pipeline.errors import InputError
    from pipeline.tracking import TrackingUnavailableError
    from tasks.stages import prepare, retry_on_tracking_outage, retry_on_transient, sft

    outage = TrackingUnavailableError("MLflow tracking at http://x is unavailable")
    wrapped = InputError("openai/gsm8k: download failed")
    wrapped.__cause__ = ConnectionResetError("reset by peer")
    assert retry_on_transient(prepare, None, _failed(wrapped))
    assert retry_on_transient(prepare, None, _failed(TimeoutError()))
    assert retry_on_transient(prepare, None, _failed(outage))
    assert not retry_on_transient(prepare, None, _failed(InputError("data/x.jsonl:3: bad row")))
    assert not retry_on_transient(prepare, None, _failed(FileNotFoundError("x")))
    assert retry_on_tracking_outage(sft, None, _failed(outage))
    assert not retry_on_tracking_outage(sft, None, _failed(RuntimeError("loss is nan")))
    assert not retry_on_tracking_outage(sft, None, _failed(ConnectionError("nccl")))  # training: never blind
    assert prepare.retries == 2 and prepare.retry_condition_fn is retry_on_transient
    assert all(t.retry_condition_fn is not None for t in (sft,))


def test_stage_task_fn_loads_config_and_exports_tracking_env(monkeypatch, tmp_path):
    import tasks.stages as ts

    seen = {}

    def fake_stage(cfg):
        seen.update(kl=cfg.grpo.kl_coef, parent=os.environ.get("GRPO_PARENT_RUN_ID"))
        return {"checkpoint": Path("checkpoints/grpo"), "reward": 0.5}

    monkeypatch.setattr(ts, "stage_function", lambda name: fake_stage)
    monkeypatch.delenv("GRPO_PARENT_RUN_ID", raising=False)
    params = tmp_path / "p.yaml"
    params.write_text("grpo:\n  kl_coef: 0.04\n")
    out = ts.grpo.fn(str(params), ["grpo.kl_coef=0.02"], parent_run_id="abc123")
    assert out == {"stage": "grpo", "checkpoint": "checkpoints/grpo", "reward": 0.5}  # JSON-only
    assert seen == {"kl": 0.02, "parent": "abc123"}
    assert "GRPO_PARENT_RUN_ID" not in os.environ  # restored after the stage
    assert list(ts.STAGE_TASKS) == list(STAGES) and [t.name for t in ts.STAGE_TASKS.values()] == list(STAGES)


def test_flow_rejects_bad_config_before_any_task(tmp_path, harness):
    from flows.grpo_pipeline import grpo_pipeline
    from pipeline.config import ConfigError

    params = tmp_path / "p.yaml"
    params.write_text("grpo:\n  kl_coefs: 0.1\n")
    state = grpo_pipeline(str(params), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="did you mean grpo.kl_coef"):
        state.result()
    assert task_runs_of(state.state_details.flow_run_id) == []


def test_flow_structure_with_fake_stages(monkeypatch, tmp_path, harness):
    """Fast: one task run per stage in order, MLflow parent + nested runs, the eval artifact."""
    import tasks.stages as ts
    from flows.grpo_pipeline import grpo_pipeline

    order = []

    def fake(name):
        def run(cfg):
            order.append((name, os.environ.get("GRPO_PREFECT_FLOW_RUN_ID")))
            from pipeline.tracking import stage_logger

            with stage_logger(cfg, name) as log:
                log.log_metrics({"train/reward": 1.0}, step=0)
            return {"metrics": {"sft": {"gsm8k_accuracy": 0.1}, "grpo": {"gsm8k_accuracy": 0.2}}} if name == "evaluate" else {}
        return run

    monkeypatch.setattr(ts, "stage_function", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    params = tmp_path / "p.yaml"
    params.write_text(f"tracking:\n  enabled: true\n  uri: {uri}\n  experiment: flowtest\n")
    state = grpo_pipeline(str(params), return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    assert [n for n, _ in order] == list(STAGES)
    assert {fr for _, fr in order} == {str(flow_run_id)}
    runs = task_runs_of(flow_run_id, expect=STAGES)
    names = [r.name.rsplit("-", 1)[0] for r in runs]  # task run names are "<task>-<n>"
    assert sorted(n for n in names if n in STAGES) == sorted(STAGES)
    assert all(r.state.is_completed() for r in runs)
    arts = {a.key: a for a in artifacts_of(flow_run_id)}
    assert arts["grpo-eval"].type == "table" and "gsm8k_accuracy" in str(arts["grpo-eval"].data)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("flowtest")
    all_runs = client.search_runs([exp.experiment_id])
    parents = [r for r in all_runs if r.data.tags.get("grpo.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["prefect.flow_run_id"] == str(flow_run_id)
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(STAGES)


def test_failed_stage_fails_the_flow_and_marks_parent_failed(monkeypatch, tmp_path, harness):
    import tasks.stages as ts
    from flows.grpo_pipeline import grpo_pipeline

    def fake(name):
        def run(cfg):
            if name == "warmup":
                raise RuntimeError("diverged")
            return {}
        return run

    monkeypatch.setattr(ts, "stage_function", fake)
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    params = tmp_path / "p.yaml"
    params.write_text(f"tracking:\n  enabled: true\n  uri: {uri}\n  experiment: failtest\n")
    state = settled_state(grpo_pipeline(str(params), return_state=True))
    assert state.is_failed(), state
    runs = {r.name.rsplit("-", 1)[0]: r for r in task_runs_of(state.state_details.flow_run_id, expect={"warmup"})}
    assert runs["warmup"].state.is_failed() and runs["warmup"].run_count == 1  # training is not retried
    assert "grpo" not in runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("failtest")
    [parent] = client.search_runs([exp.experiment_id])
    assert parent.info.status == "FAILED"


# --------------------------------------------------------------------------- end to end (real smoke stages)

def test_smoke_pipeline_through_flow(tmp_path, harness, monkeypatch):
    """The real smoke pipeline through the flow: one task run per stage, the artifact, the file set."""
    from flows.grpo_pipeline import grpo_pipeline

    flow_dir = copy_repo(tmp_path / "flow", git=False)
    monkeypatch.chdir(flow_dir)
    state = grpo_pipeline("params.yaml", ["tracking.enabled=true", "tracking.uri=sqlite:///mlflow.db"],
                          return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    runs = task_runs_of(flow_run_id, expect=STAGES)
    per_stage = {s: [r for r in runs if r.name.rsplit("-", 1)[0] == s] for s in STAGES}
    assert all(len(v) == 1 and v[0].state.is_completed() for v in per_stage.values()), per_stage
    arts = {a.key: a for a in artifacts_of(flow_run_id)}
    assert "grpo-eval" in arts
    metrics = json.loads((flow_dir / "metrics" / "eval.json").read_text())
    assert set(metrics) == {"sft", "warmup", "grpo"}
    assert str(metrics["grpo"]) and "grpo" in str(arts["grpo-eval"].data)

    assert output_files(flow_dir) == smoke_outputs()  # test_dvc checks `dvc repro` gives the same set
