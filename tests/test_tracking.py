"""MLflow tracking: parent/nested runs across processes, tags, metrics with steps, tables,
fail-fast on an unreachable server, and the `compare` table. One SQLite store per module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from pipeline.core.config import Config, TrackingConfig
from pipeline.tracking import (NullLogger, TrackingUnavailableError, end_pipeline_run, stage_logger,
                               start_pipeline_run, temporary_env)
from pipeline.tracking.compare import compare_text as compare_runs
from tests.conftest import GSM8K, QUIET_ENV, REPO


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    for k, v in QUIET_ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("MLFLOW_TRACKING_URI", "GRPO_PARENT_RUN_ID", "GRPO_PREFECT_FLOW_RUN_ID", "DVC_STAGE",
              "DVC_EXP_NAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)  # dvc.lock / git lookups see an empty folder


def make_cfg(uri: str, experiment: str, **grpo) -> Config:
    cfg = Config(tracking=TrackingConfig(enabled=True, uri=uri, experiment=experiment))
    for k, v in grpo.items():
        setattr(cfg.grpo, k, v)
    return cfg


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def runs(uri: str, experiment: str):
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    return c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tables_under_one_name_append_and_a_failing_call_stops_only_its_kind(store, capsys, tmp_path,
                                                                             monkeypatch):
    """MLflow lists every table name in a run tag capped at 8,000 characters (about 145 names), so the
    trainer logs its samples under one name per stage; and a failing table call must not stop metrics."""
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    cfg = make_cfg(store, "tables")
    with stage_logger(cfg, "warmup") as log:
        for it in (1, 2, 3):
            log.log_table([{"iteration": it, "completion": "x" * it}], "samples/warmup.json")
        def broken(*args, **kwargs):
            raise RuntimeError("artifact store down")
        monkeypatch.setattr(log.client, "log_table", broken)
        for it in (1, 2, 3):
            log.log_metrics({"train/reward": 0.5 * it}, step=it)
            log.log_table([{"iteration": it}], "samples/other.json")
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "log_table" in warnings[0] and "artifact store down" in warnings[0]
    assert "Downloading artifacts" not in err  # appending downloads the table: no progress bar per call
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    (run,) = [r for r in runs(store, "tables") if r.data.tags.get("grpo.role") == "stage"]
    c = client(store)
    assert [m.step for m in c.get_metric_history(run.info.run_id, "warmup/reward")] == [1, 2, 3]
    table = json.loads(Path(c.download_artifacts(run.info.run_id, "samples/warmup.json", str(tmp_path))).read_text())
    assert [row[table["columns"].index("iteration")] for row in table["data"]] == [1, 2, 3]
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [{"path": "samples/warmup.json", "type": "table"}]


def test_disabled_tracking_yields_null_logger():
    cfg = Config(tracking=TrackingConfig(enabled=False, uri="http://127.0.0.1:1"))
    with stage_logger(cfg, "sft") as log:
        assert isinstance(log, NullLogger)
    with stage_logger(make_cfg("http://127.0.0.1:1", "x"), "sft", enabled=False) as log:  # rank != 0
        assert isinstance(log, NullLogger)
    assert start_pipeline_run(cfg) is None


def by_stage(all_runs) -> dict:
    return {r.data.tags["grpo.stage"]: r for r in all_runs if r.data.tags.get("grpo.role") == "stage"}


@pytest.mark.slow
def test_bare_stages_log_one_top_level_run_each(store, monkeypatch):
    """`dvc repro` by hand: no parent; each stage one run, tagged with its stage, DVC stage and experiment."""
    cfg = make_cfg(store, "bare")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-a")
    for stage in ("prepare", "sft", "grpo"):
        monkeypatch.setenv("DVC_STAGE", stage)
        with stage_logger(cfg, stage) as log:
            for it in range(3):
                log.log_metrics({"train/reward": 0.1 * it, "train/kl": 0.01}, step=it)
            log.log_params({"extra.n_params": 123, "grpo.kl_coef": cfg.grpo.kl_coef})  # repeat is fine
    all_runs = runs(store, "bare")
    assert [r.data.tags["grpo.stage"] for r in all_runs] == ["prepare", "sft", "grpo"]
    for r in all_runs:
        assert "mlflow.parentRunId" not in r.data.tags and r.info.status == "FINISHED"
        assert r.data.tags["dvc.stage"] == r.data.tags["grpo.stage"] and r.data.tags["dvc.exp_name"] == "exp-a"
        assert r.info.run_name.startswith(r.data.tags["grpo.stage"] + " · exp-a")
        # what the floats depend on beyond code and params: torch build and the CPU's kernel set
        assert r.data.tags["env.torch"] == torch.__version__
        assert r.data.tags["env.cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
        assert r.data.params["sft.steps"] == str(cfg.sft.steps)
    grpo = by_stage(all_runs)["grpo"]
    hist = client(store).get_metric_history(grpo.info.run_id, "grpo/reward")  # namespaced by stage
    assert [(m.step, round(m.value, 3)) for m in hist] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert "train/reward" not in grpo.data.metrics and grpo.data.params["extra.n_params"] == "123"
    assert f"kl_coef={cfg.grpo.kl_coef:g}" in grpo.info.run_name  # the list of runs reads


def test_stages_nest_under_the_parent_they_are_given(store):
    cfg = make_cfg(store, "parents")
    parent = start_pipeline_run(cfg, name="pipeline all", tags={"prefect.flow_run_id": "abc"})
    with temporary_env({"GRPO_PARENT_RUN_ID": parent, "GRPO_PREFECT_FLOW_RUN_ID": "abc"}):
        for stage in ("grpo", "evaluate"):
            with stage_logger(cfg, stage) as log:
                log.log_metrics({"train/reward": 0.5} if stage == "grpo" else {"eval/grpo/gsm8k_accuracy": 0.25}, 0)
                if stage == "evaluate":
                    log.log_table([{"stage": "grpo", "accuracy": 0.5}], "eval_table")
                    Path("report.txt").write_text("hello")
                    log.log_artifact("report.txt")
    all_runs = runs(store, "parents")
    assert client(store).get_run(parent).info.status == "RUNNING"  # the caller closes it, not a stage
    stages = by_stage(all_runs)
    for r in stages.values():
        assert r.data.tags["mlflow.parentRunId"] == parent and r.data.tags["prefect.flow_run_id"] == "abc"
    assert {"eval_table.json", "report.txt"} <= {a.path for a in client(store).list_artifacts(stages["evaluate"].info.run_id)}
    end_pipeline_run(cfg, parent, "FINISHED")
    done = client(store).get_run(parent)
    assert done.info.status == "FINISHED" and done.info.run_name == "pipeline all"
    assert done.data.metrics == {"grpo/reward": 0.5, "eval/grpo/gsm8k_accuracy": 0.25}  # the stages' finals
    assert done.data.params["grpo.kl_coef"] == str(cfg.grpo.kl_coef)


def test_failed_stage_marks_its_run_failed(store):
    cfg = make_cfg(store, "failed")
    with pytest.raises(RuntimeError), stage_logger(cfg, "grpo") as log:
        log.log_metrics({"train/reward": 0.0}, step=0)
        raise RuntimeError("diverged")
    [run] = runs(store, "failed")
    assert run.info.status == "FAILED"


def test_env_tracking_uri_overrides_config(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg = make_cfg("http://127.0.0.1:1", "env-override")  # would fail if used
    with stage_logger(cfg, "sft"):
        pass
    assert len(runs(store, "env-override")) == 1


def test_unreachable_server_fails_fast_with_one_line(monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = make_cfg(uri, "down")
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailableError) as info, stage_logger(cfg, "grpo"):
        pytest.fail("the stage body (training) must not start")
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    assert uri in msg and "--set tracking.enabled=false" in msg and "\n" not in msg


@pytest.mark.slow
def test_compare_cli_fails_fast_when_server_down(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"tracking:\n  uri: http://127.0.0.1:{free_port()}\n  experiment: x\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "compare", "--params", str(params)],
                          cwd=REPO, capture_output=True, text=True, check=False, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0 and "tracking.enabled=false" in proc.stderr


def test_compare_runs_lists_pipelines_side_by_side(store):
    for kl in (0.04, 0.02):
        cfg = make_cfg(store, "compare", kl_coef=kl)
        parent = start_pipeline_run(cfg)
        with temporary_env({"GRPO_PARENT_RUN_ID": parent}):
            with stage_logger(cfg, "grpo") as log:
                log.log_metrics({"train/reward": kl * 10}, step=0)
                log.log_metrics({"train/reward": kl * 20}, step=1)
            with stage_logger(cfg, "evaluate") as log:
                log.log_metrics({"eval/gsm8k_accuracy": kl}, step=0)
        end_pipeline_run(cfg, parent)
    text = compare_runs(make_cfg(store, "compare"))
    assert "2 run(s)" in text
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:]}
    assert lines["param:grpo.kl_coef"] == ["0.02", "0.04"]  # newest first
    assert lines["grpo/reward"] == ["0.4", "0.8"]  # final (last step) values
    assert "eval/gsm8k_accuracy" in lines
    assert "no pipeline or stage runs" in compare_runs(make_cfg(store, "empty"))


def test_a_skipped_stage_shows_the_results_of_the_run_that_produced_its_outputs(store, tmp_path, monkeypatch):
    """`dvc repro` ran grpo (no parent); then a flow whose grpo DVC skipped: its parent carries the
    metrics of the run whose outputs it used, and names it. compare lists both, the bare runs as
    a `dvc exp <name>` column (it used to say "No pipeline runs" and show `-` for skipped stages)."""
    from pipeline.tracking.common import outputs_digest

    (tmp_path / "dvc.yaml").write_text("stages:\n  grpo:\n    cmd: x\n    outs:\n      - checkpoints/grpo\n"
                                       "    metrics:\n      - metrics/train.json:\n          cache: false\n")
    (tmp_path / "checkpoints" / "grpo").mkdir(parents=True)
    (tmp_path / "checkpoints" / "grpo" / "model.safetensors").write_bytes(b"weights")
    cfg = make_cfg(store, "reuse")
    monkeypatch.setenv("DVC_EXP_NAME", "by-hand")
    with stage_logger(cfg, "grpo") as log:
        log.log_metrics({"train/reward": 0.75}, step=5)
    monkeypatch.delenv("DVC_EXP_NAME")
    digest = outputs_digest("grpo")
    producer = by_stage(runs(store, "reuse"))["grpo"]
    assert producer.data.tags["grpo.outputs"] == digest and len(digest) == 64
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.json").write_text("{}")  # a report file: not part of the outputs
    assert outputs_digest("grpo") == digest

    parent = start_pipeline_run(cfg)
    end_pipeline_run(cfg, parent, "FINISHED", reused={"grpo": digest, "sft": "0" * 64})
    run = client(store).get_run(parent)
    assert run.data.metrics["grpo/reward"] == 0.75
    assert run.data.tags["grpo.reused.grpo"] == producer.info.run_id
    assert run.data.tags["grpo.reused.sft"].startswith("unknown")

    text = compare_runs(cfg)
    header = text.splitlines()[1]
    assert "2 run(s)" in text and "dvc exp by-hand" in header, text
    rewards = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:]}["grpo/reward"]
    assert rewards == ["0.75", "0.75"], text


def test_prepare_is_a_stage_run_with_its_data_figures(store, tmp_path):
    """prepare opens its own stage run: row counts, rejections, vocabulary and token lengths as
    metrics, data/stats.json as an artifact."""
    import dataclasses

    from pipeline.stages.prepare import run_prepare

    cfg = make_cfg(store, "prepare-run")
    cfg.data = dataclasses.replace(cfg.data, gsm8k_source=str(GSM8K), val_size=20, arith_train_size=200,
                                   arith_eval_size=20, vocab_size=400)
    out = run_prepare(cfg)
    (run,) = [r for r in runs(store, "prepare-run") if r.data.tags.get("grpo.role") == "stage"]
    assert run.info.run_name.startswith("prepare") and run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["data/gsm8k_train_rows"] == out["counts"]["gsm8k_train"] == 80 - 20
    assert m["data/arith_eval_rows"] == 20 and m["data/rejected_rows"] == 0
    assert m["data/arith_train_response_max_tokens"] >= m["data/arith_train_response_mean_tokens"] > 0
    assert run.data.params["data.val_size"] == "20"
    assert "stats.json" in {a.path for a in client(store).list_artifacts(run.info.run_id)}


def test_saved_calls_are_json_data_that_a_later_run_delivers_and_a_foreign_file_is_not_run(store, tmp_path):
    """What a slow server did not take is saved as JSON (metrics, tags, params, a table, the run's end)
    and delivered by the next run; a file that names any other function, or is a pickle, is left alone."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.mlflow_backend import deliver_pending, pending_runs
    from pipeline.tracking.mlflow_logger import PENDING_DIR, MlflowLogger

    c = MlflowClient(tracking_uri=store)
    exp = c.create_experiment("saved-calls")
    run_id = c.create_run(exp).info.run_id
    class Stuck:  # a server that takes no call: every call waits forever
        def __getattr__(self, name):
            return lambda *args, **kwargs: threading.Event().wait()

    log = MlflowLogger(Stuck(), run_id, store)
    log.log_params({"grpo.lr": 1e-5, "model.name": "tiny"})
    log.log_metrics({"reward": 0.5, "kl": float("nan"), "skipped": None}, step=3)
    log.set_tags({"grpo.note": "saved"})
    log.log_table([{"q": "1+1", "ok": True}], "samples")
    assert log.end("FINISHED", timeout=0.5) is False
    saved = tmp_path / PENDING_DIR / f"{run_id}.json"
    record = json.loads(saved.read_text())  # plain JSON: nothing in it runs when it is read
    assert record["run_id"] == run_id and [c[0] for c in record["calls"]] == [
        "log_params", "log_metrics", "set_tags", "log_table", "set_terminated"]
    assert pending_runs() == {run_id}

    deliver_pending(c, store, timeout=30)
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["grpo.lr"] == "1e-05"
    assert run.data.metrics["reward"] == 0.5 and run.data.tags["grpo.note"] == "saved"
    assert [h.step for h in c.get_metric_history(run_id, "reward")] == [3]
    assert "samples.json" in [a.path for a in c.list_artifacts(run_id)]
    assert not list((tmp_path / PENDING_DIR).iterdir())

    # a file naming a function outside the allowed few, and a pickle: refused, kept, never run
    folder = tmp_path / PENDING_DIR
    other = c.create_run(exp).info.run_id
    (folder / f"{other}.json").write_text(json.dumps({"uri": store, "run_id": other, "calls": [
        ["x", {"with_logger": "os:system"}, ["touch hacked"], {"dict": {}}]]}))
    third = c.create_run(exp).info.run_id
    (folder / f"{third}.pkl").write_bytes(b"\x80\x04K\x01.")
    deliver_pending(c, store, timeout=1)
    assert not (tmp_path / "hacked").exists()
    assert sorted(p.suffix for p in folder.iterdir()) == [".invalid", ".pkl"]
    assert c.get_run(other).info.status == "RUNNING" and pending_runs() == set()


def test_a_new_version_of_weights_evaluated_before_carries_that_evaluation(store, tmp_path):
    """grpo re-run to the same weights (DVC then skips or restores evaluate): the new registry version
    gets the eval.* tags of the earlier version of that checkpoint, instead of an empty row."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking.mlflow_models import _register, tag_model_with_eval

    c = MlflowClient(tracking_uri=store, registry_uri=store)
    exp = c.create_experiment("registry")
    first, second = (c.create_run(exp).info.run_id for _ in range(2))
    (tmp_path / "checkpoints" / "grpo").mkdir(parents=True)
    (tmp_path / "checkpoints" / "grpo" / "manifest.json").write_text('{"files": {}}')
    cfg = make_cfg(store, "registry")
    cfg.tracking.registered_model = "policy-under-test"
    from pipeline.tracking.mlflow_models import checkpoint_sha256

    sha = checkpoint_sha256(tmp_path / "checkpoints" / "grpo")
    _register(c, "policy-under-test", first, sha)
    assert tag_model_with_eval(cfg, {"gsm8k_accuracy": 0.25}) == 1
    _register(c, "policy-under-test", second, sha)  # the same weights again; evaluate does not run
    _register(c, "policy-under-test", second, "f" * 64)  # other weights: nothing to carry
    versions = {str(v.version): v.tags for v in c.search_model_versions("name = 'policy-under-test'")}
    assert versions["2"]["eval.gsm8k_accuracy"] == "0.25" and "eval.gsm8k_accuracy" not in versions["3"]


def test_a_checkpoint_is_an_mlflow_model_that_loads_and_generates(store, tmp_path, gpt_policy, monkeypatch):
    """The stage's checkpoint becomes a LoggedModel of its run (the run's output: the runs list's
    Models column), registered from it, and `mlflow.pyfunc.load_model` gives the same greedy
    completions as the policy itself (models from code: no pickle)."""
    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    from pipeline.rl.generation import generate
    from pipeline.tracking.mlflow_models import MODEL_ID_TAG, _log_model, _register_uploaded, checkpoint_sha256
    from pipeline.train.checkpoint import save_policy

    folder = tmp_path / "checkpoints" / "grpo"
    save_policy(folder, gpt_policy)
    sha = checkpoint_sha256(folder)
    c = MlflowClient(tracking_uri=store, registry_uri=store)
    run_id = c.create_run(c.create_experiment("models")).info.run_id
    log = types.SimpleNamespace(client=c, run_id=run_id, _broken=set())
    _log_model(log, str(folder), "grpo", sha)
    _register_uploaded(log, "policy-as-model", sha)

    run = c.get_run(run_id)
    model_id = run.data.tags[MODEL_ID_TAG]
    assert [o.model_id for o in run.outputs.model_outputs] == [model_id]
    model = c.get_logged_model(model_id)
    assert (model.name, model.source_run_id, model.status.to_proto()) == ("grpo", run_id, 2)  # READY
    assert model.tags["grpo.checkpoint_sha256"] == sha
    (found,) = c.search_model_versions("name = 'policy-as-model'")
    version = c.get_model_version("policy-as-model", found.version)
    assert version.tags[MODEL_ID_TAG] == model_id and version.source == model.artifact_location
    files = {f.path for f in c.list_logged_model_artifacts(model_id)} if hasattr(c, "list_logged_model_artifacts") \
        else None
    assert files is None or "MLmodel" in files

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # models:/ resolves through the default URIs
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", store)
    loaded = mlflow.pyfunc.load_model("models:/policy-as-model/1")
    prompts = ["1 + 2 =", "a b c"]
    want, _, _ = generate(gpt_policy, prompts, batch_size=2, max_new_tokens=8)
    assert loaded.predict(prompts, params={"max_new_tokens": 8}) == want
    import pandas as pd

    assert loaded.predict(pd.DataFrame({"prompt": prompts}), params={"max_new_tokens": 8}) == want
    from pipeline.policy_model import prompts_of

    assert prompts_of("x") == ["x"] and prompts_of(pd.DataFrame({"q": ["x", "y"]})) == ["x", "y"]
    with pytest.raises(ValueError, match="'prompt' column"):
        prompts_of(pd.DataFrame({"a": ["x"], "b": ["y"]}))
    with pytest.raises(ValueError, match="expected prompt strings"):
        prompts_of([1, 2])
