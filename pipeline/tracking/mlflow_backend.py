"""MLflow adapter behind :mod:`pipeline.tracking`: the only module that imports the MLflow SDK.

Run layout. The caller of a pipeline execution (the Prefect flow, ``python -m pipeline all``,
``make run``) opens one *parent* run and hands its id down in ``GRPO_PARENT_RUN_ID``; each stage
logs one run nested under it (MLflow's ``mlflow.parentRunId``) and never closes it. A stage with no
parent (``dvc repro`` or ``python -m pipeline grpo`` by hand) logs one top-level run, tagged with
its stage, DVC stage and experiment name. Nothing here reads DVC's files.

Tags use MLflow's names: ``mlflow.source.git.commit`` (the commit when the pipeline started: a
stage copies its parent's), ``mlflow.runName``, ``mlflow.parentRunId``; ours are ``grpo.role``
(pipeline / stage), ``grpo.stage``, ``grpo.dirty``, ``grpo.workspace``, ``grpo.experiment``.

No run stays RUNNING. A stage that raises marks its run FAILED (KILLED on Ctrl-C); a process
killed outright cannot, so every run records its process (``grpo.host``, ``grpo.pid``) and every
new run first marks KILLED the RUNNING runs whose process is gone from this host.

Failure policy: the tracking backend is probed when a stage starts, *before* any training; an
unreachable server raises :class:`TrackingUnavailableError` (an ``InputError``: one line, exit 2)
naming the URI and how to turn tracking off. Calls during training go
through one logging thread (:class:`MlflowLogger`), so the training loop never waits on the server.
A failure while logging warns once and turns off calls of the same kind (metrics, tables,
artifacts, tags) for that stage: training is never lost for the sake of a metric, and a broken
artifact store does not take the metrics with it; a server that stops answering warns once and
turns tracking off for the stage. At the stage's end the queue is flushed for at most
``FLUSH_TIMEOUT_S``, then given up with one warning. MLflow's own HTTP knobs bound every call:
``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default here 30 s) and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
(default here 2; MLflow's own default retries with backoff for minutes). A URI that cannot work
(an unknown scheme, a file store, an sqlite path that cannot be written) is refused at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.config import CHECKPOINT_DIR, Config
from pipeline.errors import InputError
from pipeline.lock import pid_alive
from pipeline.tracking.common import (FLOW_RUN_ENV, PARENT_RUN_ENV, TrackingUnavailableError, experiment_label,
                                      git_state, resolve_uri, run_name, runtime_tags, temporary_env)

PROBE_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 10.0  # the most a stage waits at its end for queued tracking calls
ROLE_TAG = "grpo.role"  # "pipeline" on parents, "stage" on stage runs
STAGE_TAG = "grpo.stage"
WORKSPACE_TAG = "grpo.workspace"
HOST_TAG, PID_TAG = "grpo.host", "grpo.pid"  # the process that owns a RUNNING run
COMMIT_TAG = "mlflow.source.git.commit"
CHECKPOINT_TAG = "grpo.checkpoint_sha256"
TRAINING_STAGES = ("sft", "warmup", "grpo")
for _knob, _value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", "30"), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")):
    os.environ.setdefault(_knob, _value)  # bounded calls unless the user chose otherwise


# --------------------------------------------------------------------------- backend

def tracking_uri(cfg: Config) -> str:
    """The effective URI: ``MLFLOW_TRACKING_URI`` wins over ``tracking.uri``; relative sqlite paths
    resolve at the repository root. A URI that cannot work is refused here, in milliseconds."""
    return check_uri(resolve_uri(os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.uri))


_DB_SCHEMES = ("postgresql", "mysql", "mssql", "databricks", "databricks-uc")


def _bad_uri(uri: str, why: str) -> TrackingUnavailableError:
    return TrackingUnavailableError(
        f"tracking.uri = {uri!r}: {why}; use http(s)://host:port or sqlite:///path/to/mlflow.db "
        "(or run without tracking: --set tracking.enabled=false)")


def check_uri(uri: str) -> str:
    """`uri` if MLflow can use it; TrackingUnavailableError (one line) for an unknown scheme, a file
    store (MLflow 3 refuses it), an http URI without a host, or an sqlite path that cannot be written
    (under a regular file, in a folder that refuses writes): MLflow itself retries those for minutes."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else uri.lower() if uri in _DB_SCHEMES else ""
    base = scheme.split("+", 1)[0]
    if base in ("http", "https"):
        if not urlparse(uri).hostname:
            raise _bad_uri(uri, "no host")
    elif base == "sqlite":
        _check_sqlite(uri)
    elif base not in _DB_SCHEMES:
        why = ("a file store (MLflow 3 supports only database and server backends)" if base in ("", "file")
               else f"unsupported scheme {scheme!r}")
        raise _bad_uri(uri, why)
    return uri


def _check_sqlite(uri: str) -> None:
    if not uri.startswith("sqlite:///"):
        return  # sqlite:// (in memory) or a driver-specific form: left to SQLAlchemy
    rest = uri[len("sqlite:///"):].split("?", 1)[0]  # sqlite:////abs/path -> /abs/path
    if rest in ("", ":memory:"):
        return
    db = Path(rest)
    if db.is_dir():
        raise _bad_uri(uri, f"{db} is a folder, not a database file")
    folder = next((p for p in db.absolute().parents if p.exists()), Path("/"))
    if not folder.is_dir():
        raise _bad_uri(uri, f"{folder} is a file, so {db} cannot be created under it")
    try:
        if db.exists():
            with open(db, "r+b"):
                pass
        with tempfile.TemporaryFile(dir=folder):
            pass  # sqlite writes a journal beside the database: the folder must take new files
    except OSError as exc:
        raise _bad_uri(uri, f"{db} cannot be written ({exc.strerror or exc})") from None


_UNREACHABLE = ("Max retries exceeded", "Connection refused", "timed out", "Failed to establish",
                "Connection aborted", "RemoteDisconnected", "Connection reset")


def _unreachable(exc: BaseException) -> bool:
    """True if `exc` says the server is gone (not that one call was wrong)."""
    import requests

    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError)):
        return True
    return any(s in str(exc) for s in _UNREACHABLE)


def _unavailable(uri: str, why: str) -> TrackingUnavailableError:
    why = " ".join(str(why).split())[:200]
    return TrackingUnavailableError(
        f"MLflow tracking at {uri} is unavailable ({why}); start the server, point tracking.uri or "
        f"MLFLOW_TRACKING_URI elsewhere, or run without tracking: --set tracking.enabled=false")


def probe(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Fail within ``timeout`` seconds if an http(s) tracking server does not answer (no retries)."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.exceptions.Timeout:
        raise _unavailable(uri, f"no answer within {timeout:g} s") from None
    except requests.exceptions.RequestException as exc:
        why = "connection refused" if "refused" in str(exc).lower() else type(exc).__name__
        raise _unavailable(uri, why) from None


def client_for(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _no_http_retries():
    """Make MLflow's REST calls fail fast while a stage starts (nothing is lost yet)."""
    return temporary_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(PROBE_TIMEOUT_S))})


def experiment_id(cfg: Config, client=None) -> str:
    """Id of ``cfg.tracking.experiment``, created if missing; fails fast if the backend is down."""
    uri = tracking_uri(cfg)
    probe(uri)
    client = client or client_for(uri)
    # a model-training experiment: MLflow 3 opens the GenAI traces page on experiments of unknown kind
    kind = {"mlflow.experimentKind": "custom_model_development"}
    try:
        with _no_http_retries():
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            if exp is None:
                return client.create_experiment(cfg.tracking.experiment, tags=kind)
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp.experiment_id)
            if "mlflow.experimentKind" not in exp.tags:
                client.set_experiment_tag(exp.experiment_id, *next(iter(kind.items())))
            return exp.experiment_id
    except InputError:
        raise
    except Exception as exc:  # any backend failure here happens before training: report it in one line
        if "already exists" in str(exc):  # created concurrently by another stage process
            return client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None


def _params(cfg: Config) -> dict[str, str]:
    return {k: str(v)[:6000] for k, v in cfg.flat().items()}


def _log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Log params, skipping those the run already has (MLflow params are write-once)."""
    from mlflow.entities import Param

    have = client.get_run(run_id).data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i:i + 100])


def _base_tags(role: str) -> dict[str, str]:
    tags = {ROLE_TAG: role, WORKSPACE_TAG: str(Path.cwd().resolve()), "mlflow.source.type": "JOB",
            HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), **runtime_tags()}
    if os.environ.get(FLOW_RUN_ENV):
        tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
    if label := experiment_label():
        tags["grpo.experiment"] = label
    for env, tag in (("DVC_STAGE", "dvc.stage"), ("DVC_EXP_NAME", "dvc.exp_name"),
                     ("DVC_EXP_BASELINE_REV", "dvc.exp_baseline_rev")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


def _git_tags() -> dict[str, str]:
    commit, dirty = git_state()
    return {COMMIT_TAG: commit, "grpo.dirty": str(dirty).lower()} if commit else {}


def close_stale_runs(client, exp_id: str) -> list[str]:
    """Mark KILLED the runs left RUNNING by a process that is gone (its pid, recorded on the run, is
    dead on this host); returns their ids. Runs of live processes, here or on other hosts, stay."""
    host = socket.gethostname().replace("'", "")
    found = client.search_runs([exp_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
                               max_results=500)
    stale = [r.info.run_id for r in found if r.data.tags.get(PID_TAG, "").isdigit()
             and not pid_alive(int(r.data.tags[PID_TAG]))]
    for run_id in stale:
        client.set_terminated(run_id, status="KILLED")
    return stale


# --------------------------------------------------------------------------- parent runs

def start_pipeline_run(cfg: Config, name: str | None = None, tags: dict[str, str] | None = None) -> str:
    """Create the parent run of one pipeline execution; returns its id."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(cfg, client)
    try:
        with _no_http_retries():
            close_stale_runs(client, exp_id)
            all_tags = {**_base_tags("pipeline"), **_git_tags(), **(tags or {})}
            run = client.create_run(exp_id, tags=all_tags, run_name=name or run_name(cfg))
    except Exception as exc:
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None
    _log_params(client, run.info.run_id, _params(cfg))
    return run.info.run_id


def end_pipeline_run(cfg: Config, run_id: str, status: str = "FINISHED") -> None:
    """Copy the stage runs' final metrics (namespaced by stage, so they never clash) onto the parent,
    then mark it FINISHED / FAILED / KILLED. A server gone by now is one warning, not a traceback
    after the work is done (the next run marks the parent KILLED: its process is gone)."""
    uri = tracking_uri(cfg)
    try:
        probe(uri)
        _end_pipeline_run(client_for(uri), run_id, status)
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200]
        print(f"warning: MLflow at {uri}: could not close the pipeline run {run_id} ({type(exc).__name__}: "
              f"{msg}); the stages' own runs hold their metrics", file=sys.stderr)


def _end_pipeline_run(client, run_id: str, status: str) -> None:
    from mlflow.entities import Metric

    parent = client.get_run(run_id)
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
                                  order_by=["attributes.start_time ASC"])
    latest: dict[str, float] = {}
    for child in children:  # a re-run stage overwrites an earlier one
        latest.update(child.data.metrics)
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, 0) for k, v in latest.items()]
    with contextlib.suppress(Exception):
        for i in range(0, len(items), 500):
            client.log_batch(run_id, metrics=items[i:i + 500])
    client.set_terminated(run_id, status=status)


def run_link(cfg: Config, parent_id: str | None, stage: str) -> str | None:
    """Where to open the newest run of ``stage`` (under ``parent_id`` when given): a UI URL for an
    http server, ``runs:/<id>`` otherwise; None when there is none."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    query = f"tags.`{STAGE_TAG}` = '{stage}'" + (f" and tags.mlflow.parentRunId = '{parent_id}'" if parent_id else "")
    found = client.search_runs([exp.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"],
                               max_results=1)
    if not found:
        return None
    run_id = found[0].info.run_id
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{exp.experiment_id}/runs/{run_id}"
    return f"runs:/{run_id}"


# --------------------------------------------------------------------------- stage logger

class MlflowLogger:
    """:class:`pipeline.tracking.Logger` writing to one MLflow run through an explicit client
    (no fluent global state, so concurrent Prefect task threads cannot mix runs up).

    Every call is queued for one logging thread: the training thread never waits on the server.
    A failing call warns once and turns off calls of its kind; a server that stops answering
    (connection refused, timeouts) warns once and turns all of them off. :meth:`close` waits at
    most FLUSH_TIMEOUT_S for what is queued, then gives up with one warning."""

    def __init__(self, client, run_id: str, uri: str):
        self.client, self.run_id, self.uri = client, run_id, uri
        self._broken: set[str] = set()
        self._down = False  # the server stopped answering: everything is skipped
        self.last: dict[str, float] = {}  # the last value of every metric logged
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"mlflow-{run_id[:8]}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            what, fn, args, kwargs = self._queue.get()
            if what == "__stop__":
                return
            if what == "__flush__":
                fn()
            else:
                self._call(what, fn, *args, **kwargs)

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        """Queue `fn(*args, **kwargs)` for the logging thread (skipped if its kind failed before)."""
        if not (self._down or what in self._broken):
            self._queue.put((what, fn, args, kwargs))

    def _call(self, what: str, fn, *args, **kwargs) -> None:
        """Call `fn`; if it fails, warn once and skip calls of the same kind for the rest of the stage
        (all calls, if the server stopped answering). Training never stops for tracking."""
        if self._down or what in self._broken:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            msg = " ".join(str(exc).split())[:200]
            if _unreachable(exc) or not self._answers():
                self._down = True
                print(f"warning: MLflow at {self.uri} stopped answering ({type(exc).__name__}: {msg}); "
                      "tracking is off for the rest of this stage, training goes on", file=sys.stderr)
                return
            self._broken.add(what)
            print(f"warning: MLflow {what} failed on {self.uri} ({type(exc).__name__}: {msg}); "
                  f"{what} disabled for the rest of this stage", file=sys.stderr)

    def _answers(self) -> bool:
        """After a failed call: does the server still answer its health check (2 s, no retries)?"""
        if not self.uri.startswith(("http://", "https://")):
            return True
        try:
            probe(self.uri, timeout=2.0)
        except TrackingUnavailableError:
            return False
        return True

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait up to `timeout` s for the queued calls; False (one warning, the rest dropped) if not done."""
        done = threading.Event()
        self._queue.put(("__flush__", done.set, (), {}))
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if self._down or time.monotonic() > deadline:  # a dead server: nothing left worth waiting for
                break
        else:
            return True
        if not self._down:
            print(f"warning: MLflow at {self.uri}: gave up after {timeout:g} s on {self._queue.qsize()} "
                  "queued tracking calls; the run's last metrics may be missing", file=sys.stderr)
        self._down = True
        return False

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Flush (bounded by `timeout`), then stop the logging thread."""
        if self.flush(timeout):
            self._queue.put(("__stop__", None, (), {}))
            self._thread.join(timeout)

    def log_params(self, params: dict[str, Any]) -> None:
        self._guard("log_params", _log_params, self.client, self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            try:
                items.append(Metric(key, float(value), ts, int(step)))
            except (TypeError, ValueError):  # not a number (e.g. None): nothing to plot
                continue
        self.last.update({m.key: m.value for m in items})
        if items:
            self._guard("log_metrics", self.client.log_batch, self.run_id, metrics=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._guard("log_artifacts", self.client.log_artifacts, self.run_id, str(path), artifact_path or path.name)
        else:
            self._guard("log_artifact", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Rows to a JSON table artifact; a second call with the same name appends to it. Log many
        small tables under one name: MLflow lists every table name in a run tag that holds 8,000
        characters, so about 145 distinct names break log_table for the run (mlflow#11874, #13170)."""
        import pandas as pd

        artifact = name if name.endswith(".json") else f"{name}.json"
        # Appending downloads the table first, and MLflow draws a progress bar for that download on
        # stderr: one per logged iteration in the stage's output. Off unless the user asked for it.
        bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
        log_table, frame = self.client.log_table, pd.DataFrame(rows)

        def quiet_log_table() -> None:  # on the logging thread, where the download happens
            with temporary_env({bar: os.environ.get(bar) or "false"}):
                log_table(self.run_id, frame, artifact)

        self._guard("log_table", quiet_log_table)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._guard("set_tags", self.client.log_batch, self.run_id,
                    tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


def _open_stage_run(client, exp_id: str, cfg: Config, stage: str) -> str:
    parent_id = os.environ.get(PARENT_RUN_ENV) or None
    close_stale_runs(client, exp_id)
    tags = {**_base_tags("stage"), STAGE_TAG: stage}
    if parent_id:  # the commit when the pipeline started, not now
        parent = client.get_run(parent_id)
        tags["mlflow.parentRunId"] = parent_id
        tags.update({k: v for k, v in parent.data.tags.items() if k in (COMMIT_TAG, "grpo.dirty", "grpo.experiment")})
    else:
        tags.update(_git_tags())
    return client.create_run(exp_id, tags=tags, run_name=run_name(cfg, stage, tags.get("grpo.experiment"))).info.run_id


@contextlib.contextmanager
def mlflow_stage_logger(cfg: Config, stage: str) -> Iterator[MlflowLogger]:
    """One run for one stage execution; fails fast (before training) if the backend is unreachable.
    On success a training stage's final checkpoint is logged (and grpo's registered)."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    exp_id = experiment_id(cfg, client)  # probe: raises TrackingUnavailableError in seconds
    try:
        with _no_http_retries():
            run_id = _open_stage_run(client, exp_id, cfg, stage)
    except Exception as exc:
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None
    log = MlflowLogger(client, run_id, uri)
    log.log_params(_params(cfg))
    try:
        yield log
        if stage in TRAINING_STAGES:
            log_checkpoint(log, cfg, stage)
        if stage == "evaluate":
            prefix = "eval/grpo/"
            grpo = {k[len(prefix):]: v for k, v in log.last.items() if k.startswith(prefix)}
            log._guard("tag_model", tag_model_with_eval, cfg, grpo)
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        log._guard("set_terminated", client.set_terminated, run_id, status=status)
        log.close()
        raise
    log._guard("set_terminated", client.set_terminated, run_id, status="FINISHED")
    log.close()  # bounded: a dead server costs at most FLUSH_TIMEOUT_S here


# --------------------------------------------------------------------------- models

def checkpoint_sha256(folder: Path) -> str | None:
    """Identity of a checkpoint: the SHA-256 of its manifest (which lists every file's SHA-256)."""
    manifest = folder / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def log_checkpoint(log: MlflowLogger, cfg: Config, stage: str) -> None:
    """Log ``checkpoints/<stage>`` as the run's ``checkpoint`` artifact (if within the size limit);
    register the grpo checkpoint as a new version of ``tracking.registered_model``."""
    folder = Path(CHECKPOINT_DIR) / stage
    sha = checkpoint_sha256(folder)
    if sha is None:
        return
    log.set_tags({CHECKPOINT_TAG: sha})
    size = _size_mb(folder)
    if not 0 < size <= cfg.tracking.log_model_max_mb:
        log.set_tags({"grpo.checkpoint_logged": f"false ({size:.0f} MB > tracking.log_model_max_mb)"})
        return
    log.log_artifact(folder, "checkpoint")
    if stage == "grpo" and cfg.tracking.registered_model:
        def register() -> None:  # runs on the logging thread, after the upload it depends on
            if "log_artifacts" not in log._broken:
                _register(log.client, cfg.tracking.registered_model, log.run_id, sha)

        log._guard("register_model", register)


def _register(client, name: str, run_id: str, sha: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="GRPO policy checkpoints (safetensors + JSON); "
                                                          "load with pipeline.checkpoint.load_policy")
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/checkpoint"
    client.create_model_version(name, source, run_id=run_id, tags={CHECKPOINT_TAG: sha})


def tag_model_with_eval(cfg: Config, metrics: dict[str, float]) -> int:
    """Put ``metrics`` (the grpo checkpoint's evaluation) on every registered version of the
    checkpoint now in ``checkpoints/grpo``; returns how many versions were tagged."""
    name = cfg.tracking.registered_model
    sha = checkpoint_sha256(Path(CHECKPOINT_DIR) / "grpo")
    if not name or sha is None:
        return 0
    client = client_for(tracking_uri(cfg))
    versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get(CHECKPOINT_TAG) == sha]
    for v in versions:
        for key, value in metrics.items():
            client.set_model_version_tag(name, v.version, f"eval.{key}", str(value))
    return len(versions)

