"""Prefect tasks and flows: unit tests call `task.fn`; flows run under `prefect_test_harness`.

The end-to-end test runs the real smoke pipeline through the flow in a temporary copy of the repo
and checks one task run per stage, the evaluation artifact, the MLflow nesting, and that the flow
writes the same files as the CLI/DVC stages.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import STAGES
from tests.conftest import REPO, copy_repo, experiment, output_files, sh, smoke_outputs, task_runs_of, tracked_repo


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
    from pipeline.core.errors import InputError
    from pipeline.tracking import TrackingUnavailableError
    from tasks.stages import STAGE_TASKS, retry_on_tracking_outage, retry_on_transient

    prepare, sft = STAGE_TASKS["prepare"], STAGE_TASKS["sft"]

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
    # training stages retry on a tracking outage only: never blindly on any error
    assert all(STAGE_TASKS[s].retry_condition_fn is retry_on_tracking_outage
               for s in ("sft", "warmup", "control", "grpo", "evaluate"))


def test_flow_rejects_bad_config_before_any_task(tmp_path, harness, monkeypatch):
    from flows.grpo_pipeline import grpo_pipeline
    from pipeline.core.config import ConfigError

    monkeypatch.chdir(REPO)
    params = tmp_path / "p.yaml"
    params.write_text("grpo:\n  kl_coefs: 0.1\n")
    state = grpo_pipeline(str(params), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="did you mean grpo.kl_coef"):
        state.result()
    assert task_runs_of(state.state_details.flow_run_id) == []


@pytest.mark.slow
def test_evaluate_flow_rejects_a_bad_checkpoint_before_prefect_starts():
    """`python -m flows.evaluate --checkpoint bogus`: one line naming evaluate.stages and the allowed
    names, exit 2, and no Prefect server or flow run (it once started both, then logged a traceback)."""
    import os
    import subprocess
    import sys

    from tests.conftest import QUIET_ENV

    res = subprocess.run([sys.executable, "-m", "flows.evaluate", "--checkpoint", "bogus"], cwd=REPO,
                         env={**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=False, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "evaluate.stages" in lines[0] and "sft, control, warmup, grpo" in lines[0], lines
    assert "Traceback" not in res.stderr and "prefect" not in res.stderr.lower()


@pytest.mark.slow
def test_the_flow_graph_is_dvcs_graph():
    """UPSTREAM names, for each stage, exactly the stages dvc.yaml makes it depend on (DVC's own graph of
    the repo), and a run waits only on its nearest ones: warmup and control on sft alone."""
    import networkx as nx
    from dvc.repo import Repo

    from flows.grpo_pipeline import stage_graph, upstream_of

    with Repo(str(REPO)) as repo:
        graph = repo.index.graph  # an edge runs from a stage to a stage it depends on
        names = {st: st.name for st in graph.nodes if Path(st.path).resolve() == REPO / "dvc.yaml"}
        dvc_upstream = {names[st]: {names[d] for d in nx.descendants(graph, st)} for st in names}
    assert {k: set(v) for k, v in stage_graph(REPO).items()} == dvc_upstream
    assert list(stage_graph(REPO)) == list(STAGES)
    assert upstream_of(STAGES, graph=stage_graph(REPO)) == {"prepare": [], "sft": ["prepare"], "warmup": ["sft"], "control": ["sft"],
                                   "grpo": ["warmup"], "evaluate": ["control", "grpo"]}
    assert upstream_of(["warmup", "grpo", "evaluate"], graph=stage_graph(REPO)) == {"warmup": [], "grpo": ["warmup"], "evaluate": ["grpo"]}
    assert upstream_of(STAGES, parallel=False)["control"] == ["warmup"]  # --sequential: the chain


RENDEZVOUS_STAGE = """import json, os, sys, time
name = sys.argv[1]
start = time.time()
os.makedirs("out", exist_ok=True)
met = None
if name in ("warmup", "control"):  # announce this branch, then wait for the other one to be running too
    other = "control" if name == "warmup" else "warmup"
    open(f"out/{name}.started", "w").close()
    deadline = time.monotonic() + float(os.environ["BRANCH_WAIT_S"])
    while not os.path.exists(f"out/{other}.started") and time.monotonic() < deadline:
        time.sleep(0.1)
    met = os.path.exists(f"out/{other}.started")
with open(f"out/{name}.json", "w") as f:
    json.dump({"met_the_other_branch": met, "start": start, "end": time.time()}, f)
with open(os.environ["GRPO_STAGE_REPORT"], "w") as f:  # the stage command's report to the task
    json.dump({"stage": name, "ran": True}, f)
"""


def rendezvous_repo(root):
    """A git + DVC repo with the pipeline's stage names and dvc.yaml's stage graph, each stage a small
    script; warmup and control each wait (up to BRANCH_WAIT_S) for the other to have started."""
    import yaml

    from flows.grpo_pipeline import stage_graph

    root.mkdir()
    (root / "stage.py").write_text(RENDEZVOUS_STAGE)
    stages = {name: {"cmd": f"python stage.py {name}", "deps": ["stage.py", *(f"out/{u}.json" for u in ups)],
                     "outs": [{f"out/{name}.json": {"cache": False}}]} for name, ups in stage_graph(REPO).items()}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    sh(root, "git", "init", "-q")
    sh(root, "dvc", "init", "-q")
    sh(root, "dvc", "config", "core.analytics", "false")
    sh(root, "git", "add", "-A")
    sh(root, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return root


def test_warmup_and_control_run_side_by_side_through_dvc(tmp_path, harness, monkeypatch):
    """run_chain submits every stage at once: warmup and control (both after sft) are running at the
    same time, each a real `dvc repro --single-item` in the same repo (each sees the other start), and
    DVC records both in dvc.lock; with parallel=False the first never sees the second start."""
    import yaml
    from prefect import flow

    from flows.grpo_pipeline import run_chain
    from tests.conftest import smoke_cfg

    cfg = smoke_cfg("tracking.enabled=false")

    @flow
    def chain(work: str, parallel: bool):
        return run_chain(STAGES, Path(work), cfg, None, None, Path(work), parallel)

    for parallel, wait_s in ((True, "120"), (False, "2")):
        monkeypatch.setenv("BRANCH_WAIT_S", wait_s)
        repo = rendezvous_repo(tmp_path / f"p{parallel}")
        out = chain(str(repo), parallel)
        assert {s: out[s]["status"] for s in STAGES} == {s: "ran" for s in STAGES}
        t = {s: json.loads((repo / "out" / f"{s}.json").read_text()) for s in STAGES}
        met = (t["warmup"]["met_the_other_branch"], t["control"]["met_the_other_branch"])
        assert met == ((True, True) if parallel else (False, True)), (parallel, t)
        assert t["grpo"]["start"] >= t["warmup"]["end"] and t["evaluate"]["start"] >= t["control"]["end"]
        lock = yaml.safe_load((repo / "dvc.lock").read_text())
        assert set(lock["stages"]) == set(STAGES)  # neither parallel stage's record was lost
        assert "up to date" in sh(repo, "dvc", "status", "dvc.yaml")


def test_a_flow_from_scratch_runs_both_branches_and_tracks_them(tmp_path, harness, monkeypatch):
    """The whole smoke pipeline through the flow on a fresh copy, MLflow on: every stage runs (warmup and
    control side by side, as the rendezvous test above proves, both writing to the one SQLite file), both
    stage runs end FINISHED under the flow's parent run, and DVC then reports every stage up to date."""
    from mlflow.tracking import MlflowClient

    from flows.grpo_pipeline import grpo_pipeline

    repo = tracked_repo(tmp_path, "branches")
    monkeypatch.chdir(repo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = grpo_pipeline(return_state=True)
    assert state.is_completed(), state
    out = state.result()
    assert {s: out[s]["status"] for s in STAGES} == {s: "ran" for s in STAGES}
    assert "up to date" in sh(repo, "dvc", "status", "dvc.yaml")
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("branches")
    all_runs = client.search_runs([exp.experiment_id])
    parent = [r for r in all_runs if r.data.tags.get("grpo.role") == "pipeline"]
    assert len(parent) == 1 and {r.info.status for r in all_runs} == {"FINISHED"}
    children = {r.data.tags["grpo.stage"]: r for r in all_runs
                if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id}
    assert set(children) == set(STAGES)
    assert "warmup/reward" in children["warmup"].data.metrics and "control/loss" in children["control"].data.metrics


def logs_of(flow_run_id, task_run_ids, timeout: float = 60.0):
    """{task run id: [messages]} once every given task run has a log line (logs arrive in batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            per_task = {t: [lg.message for lg in logs if lg.task_run_id == t] for t in task_run_ids}
            if all(per_task.values()) or time.monotonic() > deadline:
                return per_task
            time.sleep(1)


def yaml_of(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def by_stage(runs) -> dict:
    return {r.name.rsplit("-", 1)[0]: r for r in runs}  # task run names are "<task>-<n>"


@pytest.mark.slow
def test_flow_runs_dvc_stages_and_an_override_is_a_dvc_experiment(tmp_path, harness, monkeypatch):
    """After `dvc repro` by hand the flow runs nothing; an override re-runs only grpo and evaluate, in
    an experiment that `dvc exp show` lists while the workspace stays as it was; the graph is the
    chain, every stage logs to Prefect, the artifacts exist, MLflow has one parent per flow run."""
    from mlflow.tracking import MlflowClient

    from flows.grpo_pipeline import grpo_pipeline, stage_graph, upstream_of

    repo = tracked_repo(tmp_path, "flows")
    monkeypatch.chdir(repo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sh(repo, "dvc", "repro")
    head = sh(repo, "git", "rev-parse", "HEAD").strip()
    before = {p: (repo / p).read_bytes() for p in ("params.yaml", "dvc.lock", "metrics/eval.json",
                                                   "checkpoints/grpo/model.safetensors", "plots/grpo.csv")}

    state = grpo_pipeline(return_state=True)  # nothing changed since `dvc repro`: DVC skips every stage
    assert state.is_completed(), state
    first, first_id = state.result(), state.state_details.flow_run_id
    assert {s: first[s]["status"] for s in STAGES} == {s: "skipped" for s in STAGES}

    # a grpo param that changes grpo's outputs on smoke params (every smoke reward is 0, so no group is
    # informative and kl_coef or lr leave the weights, hence evaluate's inputs, bit-identical)
    state = grpo_pipeline(overrides=["grpo.iterations=3"], return_state=True)
    assert state.is_completed(), state
    out, flow_run_id = state.result(), state.state_details.flow_run_id
    assert {s: out[s]["status"] for s in STAGES} == {"prepare": "skipped", "sft": "skipped", "warmup": "skipped",
                                                      "control": "skipped", "grpo": "ran", "evaluate": "ran"}
    assert {p: (repo / p).read_bytes() for p in before} == before  # the workspace as it was found
    assert "up to date" in sh(repo, "dvc", "status", "dvc.yaml")
    data = experiment(repo, out["experiment"])  # `dvc exp show` lists it, with its param and metrics
    assert data["params"]["params.yaml"]["data"]["grpo"]["iterations"] == 3
    assert "reward_final" in data["metrics"]["metrics/train.json"]["data"]["grpo"]

    # the graph is dvc.yaml's (warmup and control both after sft), and every stage logged to Prefect
    runs = by_stage(task_runs_of(flow_run_id, expect=STAGES))
    for name, ups in upstream_of(STAGES, graph=stage_graph(REPO)).items():
        assert sorted(i.id for i in runs[name].task_inputs["upstream"]) == sorted(runs[u].id for u in ups), name
    logs = logs_of(flow_run_id, [runs[s].id for s in STAGES])
    assert all(logs[runs[s].id] for s in STAGES), logs
    # an iteration's line carries its time and the time left (no bar under DVC or Prefect)
    assert any(re.match(r"grpo 3/3 .* [\d.]+ s/it, eta 0s$", m) for m in logs[runs["grpo"].id]), logs[runs["grpo"].id]
    # logs worth reading: no progress-bar redraws (MLflow's copy of the checkpoint into its model), no raw
    # colour codes (MLflow's type-hint advice), though grpo and evaluate logged and registered their models
    flat = [m for lines in logs.values() for m in lines]
    assert not [m for m in flat if "\x1b[" in m or re.search(r"\d+%\|", m) or "Downloading artifacts" in m], flat
    # nor DVC's advice to `git add` what it changed: in the experiment's throwaway copy DVC stages it itself
    assert not [m for m in flat if "git add" in m or "core.autostage" in m], flat
    arts = {a.key: a for a in artifacts_of(flow_run_id)}
    assert {"grpo-sft", "grpo-warmup", "grpo-control", "grpo-grpo", "grpo-eval"} <= set(arts)
    assert "| loss |" in arts["grpo-control"].data  # the control's series is read like sft's
    assert "| reward |" in arts["grpo-grpo"].data and "runs:/" in arts["grpo-grpo"].data

    # MLflow: the bare `dvc repro` logged one top-level run per stage; each flow run one parent
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("flows")
    all_runs = client.search_runs([exp.experiment_id])
    assert {r.info.status for r in all_runs} == {"FINISHED"}
    top = [r for r in all_runs if "mlflow.parentRunId" not in r.data.tags and r.data.tags.get("grpo.role") == "stage"]
    assert sorted(r.data.tags["dvc.stage"] for r in top) == sorted(STAGES)
    parents = {r.data.tags["prefect.flow_run_id"]: r for r in all_runs if r.data.tags.get("grpo.role") == "pipeline"}
    assert set(parents) == {str(first_id), str(flow_run_id)}
    mine = parents[str(flow_run_id)]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == mine.info.run_id]
    assert sorted(r.data.tags["grpo.stage"] for r in children) == ["evaluate", "grpo"]
    assert {r.data.tags["mlflow.source.git.commit"] for r in all_runs} == {head}
    assert "grpo/reward" in mine.data.metrics and any(k.startswith("eval/grpo/") for k in mine.data.metrics)
    assert mine.data.tags["grpo.experiment"] == out["experiment"]
    # tagged like `dvc exp run`'s runs: the experiment's name, and params edits do not count as dirty
    assert {r.data.tags.get("dvc.exp_name") for r in [mine, *children]} == {out["experiment"]}
    assert {r.data.tags["grpo.dirty"] for r in all_runs} == {"false"}
    # the stages DVC skipped show the results of the runs whose outputs they used (here `dvc repro`'s)
    producers = {r.data.tags["grpo.stage"]: r.info.run_id for r in top}
    first_parent = parents[str(first_id)]
    assert {s: first_parent.data.tags.get(f"grpo.reused.{s}") for s in STAGES} == producers
    assert "warmup/reward" in first_parent.data.metrics and any(k.startswith("eval/grpo/") for k in first_parent.data.metrics)
    assert {s: mine.data.tags.get(f"grpo.reused.{s}") for s in ("prepare", "sft", "warmup", "control")} == {
        s: producers[s] for s in ("prepare", "sft", "warmup", "control")}
    assert "warmup/reward" in mine.data.metrics and "control/loss" in mine.data.metrics
    versions = client.search_model_versions("name = 'grpo-policy'")
    assert versions and any(k.startswith("eval.") for v in versions for k in v.tags)

    # a params file other than params.yaml is an experiment too (the run cache restores what it changes)
    other = {**yaml_of(repo / "params.yaml")}
    other["grpo"]["iterations"] = 3
    (repo / "other.yaml").write_text(yaml.safe_dump(other))
    state = grpo_pipeline(params_path="other.yaml", return_state=True)
    assert state.is_completed(), state
    again = state.result()
    assert experiment(repo, again["experiment"])["params"]["params.yaml"]["data"]["grpo"]["iterations"] == 3
    assert {s: again[s]["status"] for s in ("grpo", "evaluate")} == {"grpo": "restored", "evaluate": "restored"}
    # git and DVC as they were: nothing tracked changed, no worktree left, `dvc status` clean
    assert sh(repo, "git", "status", "--porcelain", "--untracked-files=no") == ""
    assert len(sh(repo, "git", "worktree", "list").splitlines()) == 1 and "up to date" in sh(repo, "dvc", "status", "dvc.yaml")

    # the readable view docs/orchestration.md gives shows the columns it names (DVC prefixes each with its file)
    [command] = [ln for ln in (REPO / "docs" / "orchestration.md").read_text().splitlines()
                 if ln.startswith("dvc exp show --md")]
    header = sh(repo, *shlex.split(command)).splitlines()[0]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[0] == "Experiment" and len(columns) == 7, columns
    assert {c.split(":")[0] for c in columns[1:]} == {"params.yaml", "metrics/train.json", "metrics/eval.json"}, columns


# --------------------------------------------------------------------------- end to end (real smoke stages)

@pytest.mark.slow
def test_smoke_pipeline_through_flow(tmp_path, harness, monkeypatch):
    """The real smoke pipeline through the flow (its tasks run DVC stages, so in a git copy): one
    task run per stage, the artifact, the same file set as `dvc repro`."""
    from flows.experiment import apply_overrides
    from flows.grpo_pipeline import grpo_pipeline

    flow_dir = copy_repo(tmp_path / "flow")
    apply_overrides(flow_dir / "params.yaml", ["tracking.enabled=true"])
    monkeypatch.chdir(flow_dir)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = grpo_pipeline("params.yaml", return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    runs = task_runs_of(flow_run_id, expect=STAGES)
    per_stage = {s: [r for r in runs if r.name.rsplit("-", 1)[0] == s] for s in STAGES}
    assert all(len(v) == 1 and v[0].state.is_completed() for v in per_stage.values()), per_stage
    arts = {a.key: a for a in artifacts_of(flow_run_id)}
    assert "grpo-eval" in arts
    metrics = json.loads((flow_dir / "metrics" / "eval.json").read_text())
    assert set(metrics) == {"sft", "control", "warmup", "grpo"}
    assert all(metrics[s]["gsm8k_examples"] == 8 for s in metrics)  # the smoke config's gsm8k_limit
    assert all(0.0 <= metrics[s]["gsm8k_accuracy"] <= 1.0 for s in metrics)
    assert "grpo" in str(arts["grpo-eval"].data)

    assert output_files(flow_dir) == smoke_outputs()  # test_dvc checks `dvc repro` gives the same set


def test_failed_stage_fails_the_flow_closes_its_parent_and_saves_no_experiment(tmp_path, harness, monkeypatch):
    """A stage's bad input ends the flow with its one-line error; the parent run is FAILED, no
    experiment is saved, no worktree is left behind and the workspace is as it was."""
    from mlflow.tracking import MlflowClient

    from flows.grpo_pipeline import grpo_pipeline
    from pipeline.core.errors import InputError

    repo = tracked_repo(tmp_path, "failing")
    monkeypatch.chdir(repo)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = (repo / "params.yaml").read_bytes()
    (tmp_path / "empty").mkdir()  # a folder without GSM8K's files (a missing one DVC refuses: below)
    state = settled_state(grpo_pipeline(overrides=[f"data.gsm8k_source={tmp_path / 'empty'}"], return_state=True))
    assert state.is_failed(), state
    with pytest.raises(InputError, match=r"^prepare: .*empty: expected train and test files"):
        state.result()
    runs = by_stage(task_runs_of(state.state_details.flow_run_id, expect={"prepare"}))
    assert runs["prepare"].state.is_failed() and runs["prepare"].run_count == 1  # bad input: not retried
    # every later stage was submitted waiting on it, and never started (the UI shows them not ready)
    assert all(runs[s].run_count == 0 and not runs[s].state.is_completed() for s in runs if s != "prepare")
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("failing")
    parents = client.search_runs([exp.experiment_id], "tags.`grpo.role` = 'pipeline'")
    assert [p.info.status for p in parents] == ["FAILED"]
    assert (repo / "params.yaml").read_bytes() == params and not (repo / "data").exists()
    assert not [e for row in json.loads(sh(repo, "dvc", "exp", "show", "--json")) for e in row.get("experiments") or []]
    assert len(sh(repo, "git", "worktree", "list").splitlines()) == 1
    # a source DVC cannot hash as prepare's dependency (a hub id, a missing path) stops before any stage
    for source in ("openai/gsm8k", tmp_path / "missing"):
        quoted = re.escape(repr(str(source)))
        with pytest.raises(InputError, match=rf"^data.gsm8k_source = {quoted}: no such file or folder; .*outside DVC"):
            grpo_pipeline(overrides=[f"data.gsm8k_source={source}"])
    assert len(sh(repo, "git", "worktree", "list").splitlines()) == 1 and not (repo / "data").exists()


def test_a_recipe_folder_brings_its_own_stage_graph():
    """recipes/smollm2/dvc.yaml is read as its own pipeline: the model stage first, no control, a chain
    (DVC's graph of that file's stages only, though the repository holds two pipelines)."""
    from flows.grpo_pipeline import stage_graph, upstream_of

    graph = stage_graph(REPO / "recipes" / "smollm2")
    assert list(graph) == ["model", "prepare", "sft", "warmup", "grpo", "evaluate"]
    assert graph["prepare"] == ("model",) and "control" not in graph
    assert upstream_of(list(graph), graph=graph) == {"model": [], "prepare": ["model"], "sft": ["prepare"],
                                                     "warmup": ["sft"], "grpo": ["warmup"], "evaluate": ["grpo"]}
    from tasks.stages import STAGE_TASKS

    assert set(graph) <= set(STAGE_TASKS)


@pytest.mark.slow
def test_recipe_flag_errors_are_one_line(tmp_path):
    for args, message in ((["--recipe", str(tmp_path)], "expected a folder with dvc.yaml and params.yaml"),
                          (["--recipe", "recipes/smollm2", "--set", "grpo.iterations=1"], "dvc exp run -S")):
        res = subprocess.run([sys.executable, "-m", "flows.grpo_pipeline", *args], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PREFECT_API_URL": ""})
        lines = (res.stdout + res.stderr).strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.slow
def test_a_prefect_server_that_is_down_is_one_line_before_any_stage():
    """PREFECT_API_URL naming a port nobody listens on: one line naming the URL and what to do, exit 2
    (it was a 119-line traceback after Prefect's retries)."""
    import socket

    from tests.conftest import QUIET_ENV

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    res = subprocess.run([sys.executable, "-m", "flows.grpo_pipeline"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO), "PREFECT_API_URL": url})
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith(f"error: PREFECT_API_URL={url}: no Prefect server answers (connection refused)"), lines


@pytest.mark.slow
def test_an_experiment_that_cannot_be_pushed_is_one_line(tmp_path):
    """A work pool's run pushes its experiment (`dvc exp push`); a remote it cannot reach is one line
    naming the experiment and the remote, not a traceback of DVC's."""
    from flows.experiment import push_experiment
    from pipeline.core.errors import InputError

    sh(tmp_path, "git", "init", "-q", "-b", "main")
    sh(tmp_path, "dvc", "init", "-q")
    sh(tmp_path, "git", "commit", "-qm", "init")
    with pytest.raises(InputError, match=r"^experiment e1: dvc exp push nowhere failed: .+") as info:
        push_experiment(tmp_path, "e1", "nowhere")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("args,needle", [
    (["--pool-type", "docker"], "--pool-type docker: give --image"),
    (["--cron", "every day"], "--cron 'every day'"),
])
@pytest.mark.slow
def test_deploy_refuses_a_pool_it_cannot_start_in_one_line(args, needle):
    res = subprocess.run([sys.executable, "-m", "flows.deploy", "--pool", "p", "--source", str(REPO), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
