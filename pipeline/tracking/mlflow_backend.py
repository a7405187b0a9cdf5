"""MLflow adapter behind :mod:`pipeline.tracking`: it and its siblings `mlflow_client` (connection),
`mlflow_logger` (the logging thread) and `mlflow_models` (checkpoints, registry) are the only modules
that import the MLflow SDK. This one holds the run lifecycle: parent runs, stage runs, stale runs.

Run layout. The caller of a pipeline execution (the Prefect flow, ``python -m pipeline all``,
``make run``) opens one *parent* run and hands its id down in ``GRPO_PARENT_RUN_ID``; each stage
logs one run nested under it (MLflow's ``mlflow.parentRunId``) and never closes it. A stage with no
parent (``dvc repro`` or ``python -m pipeline grpo`` by hand) logs one top-level run, tagged with
its stage, DVC stage and experiment name. Nothing here reads DVC's files.

Tags use MLflow's names: ``mlflow.source.git.commit`` (the commit when the pipeline started: a
stage copies its parent's), ``mlflow.runName``, ``mlflow.parentRunId``; ours are ``grpo.role``
(pipeline / stage), ``grpo.stage``, ``grpo.dirty``, ``grpo.workspace``, ``grpo.experiment``.

No run stays RUNNING. A stage that raises marks its run FAILED (KILLED on Ctrl-C or SIGTERM); a
process killed outright cannot, so every run records its process (``grpo.host``, ``grpo.pid``) and
every new run first marks KILLED the RUNNING runs whose process is gone from this host, except
those whose end is among the calls saved for later (below): it makes those calls instead.

Failure policy: the tracking backend is probed when a stage starts, *before* any training; an
unreachable server raises :class:`TrackingUnavailableError` (an ``InputError``: one line, exit 2)
naming the URI and how to turn tracking off. Calls during training go
through one logging thread (:class:`MlflowLogger`), so the training loop never waits on the server.
A failure while logging warns once and turns off calls of the same kind (metrics, tables,
artifacts, tags) for that stage: training is never lost for the sake of a metric, and a broken
artifact store does not take the metrics with it; a server that stops answering warns once and
turns tracking off for the stage. A run's end is never dropped: at the stage's end the run's end
is queued behind its last metrics and checkpoint, and the stage waits for them while the server
answers, at most ``END_TIMEOUT_S`` (120 s; ``GRPO_TRACKING_END_TIMEOUT_S``; 5 s for a failed or
interrupted stage), with a progress line every 10 s. Whatever is not delivered by then, or to a
server that stopped answering, is saved under ``mlruns/pending/`` at the repository root; the
next run that starts here (a stage, a parent) makes those calls first (at most
``PENDING_TIMEOUT_S``), so the run ends FINISHED with all its metrics. MLflow's own HTTP knobs bound every call:
``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default here 30 s) and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
(default here 2; MLflow's own default retries with backoff for minutes). A URI that cannot work
(an unknown scheme, a file store, an sqlite path that cannot be written) is refused at once.
"""


from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.config import TRAINING_STAGES, Config
from pipeline.core.lock import pid_alive
from pipeline.tracking.common import (FLOW_RUN_ENV, PARENT_RUN_ENV, experiment_label, git_state, outputs_digest,
                                      repo_root, run_name, runtime_tags)
from pipeline.tracking.mlflow_client import (COMMIT_TAG, END_TIMEOUT_S, HOST_TAG, OUTPUTS_TAG, PENDING_TIMEOUT_S, PID_TAG,
                                             REUSED_TAG, ROLE_TAG, STAGE_TAG, STOPPED_END_TIMEOUT_S,
                                             WORKSPACE_TAG, _log_params, _no_http_retries, _params, _unavailable,
                                             client_for, experiment_id, probe, tracking_uri)
from pipeline.tracking.mlflow_logger import PENDING_DIR, MlflowLogger, load_pending
from pipeline.tracking.mlflow_models import log_checkpoint, tag_model_with_eval


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


def deliver_pending(client, uri: str, timeout: float = PENDING_TIMEOUT_S) -> None:
    """Make the calls earlier runs saved because the server did not take them in time (their ends
    among them), oldest first; what still fails is saved again for the next run."""
    for path, record in load_pending(uri):
        log = MlflowLogger(client, record["run_id"], uri)
        for call in record["calls"]:
            log._put(call)
        log.finish(timeout)  # what it does not make is saved anew (<run>.json)
        path.unlink(missing_ok=True)


def pending_runs() -> set[str]:
    """The runs whose end is still among the saved calls (any server's): never marked KILLED."""
    folder = repo_root() / PENDING_DIR
    return ({p.name.split(".", 1)[0] for p in folder.iterdir() if p.suffix in (".json", ".taking")}
            if folder.is_dir() else set())


def close_stale_runs(client, exp_id: str, uri: str | None = None) -> list[str]:
    """Mark KILLED the runs left RUNNING by a process that is gone (its pid, recorded on the run, is
    dead on this host); returns their ids. Runs of live processes, here or on other hosts, stay. With
    ``uri``, the calls earlier runs saved for it are made first, so a run whose end was among them
    ends with its own status; a run whose end is still saved is not touched."""
    if uri:
        deliver_pending(client, uri)
    host = socket.gethostname().replace("'", "")
    found = client.search_runs([exp_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
                               max_results=500)
    pending = pending_runs()
    stale = [r.info.run_id for r in found if r.data.tags.get(PID_TAG, "").isdigit()
             and not pid_alive(int(r.data.tags[PID_TAG])) and r.info.run_id not in pending]
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
            close_stale_runs(client, exp_id, uri)
            all_tags = {**_base_tags("pipeline"), **_git_tags(), **(tags or {})}
            run = client.create_run(exp_id, tags=all_tags, run_name=name or run_name(cfg))
    except Exception as exc:
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None
    _log_params(client, run.info.run_id, _params(cfg))
    return run.info.run_id


def end_pipeline_run(cfg: Config, run_id: str, status: str = "FINISHED",
                     reused: dict[str, str | None] | None = None) -> None:
    """Copy the stage runs' final metrics (namespaced by stage, so they never clash) onto the parent,
    then mark it FINISHED / FAILED / KILLED. ``reused``: {stage: outputs digest} of the stages DVC
    skipped (or restored from its run cache): the metrics of the newest finished run that produced
    those same outputs are copied too, and the parent names it (``grpo.reused.<stage>``), so every
    pipeline run shows the results it used, whoever produced them. A server gone by now is one
    warning, not a traceback after the work is done (the next run marks the parent KILLED)."""
    uri = tracking_uri(cfg)
    try:
        probe(uri)
        client = client_for(uri)
        with _no_http_retries():
            deliver_pending(client, uri)  # the stages' last metrics, before they are copied onto the parent
        _end_pipeline_run(client, run_id, status, reused or {})
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200]
        print(f"warning: MLflow at {uri}: could not close the pipeline run {run_id} ({type(exc).__name__}: "
              f"{msg}); the stages' own runs hold their metrics", file=sys.stderr)


def producer_run(client, exp_id: str, stage: str, digest: str | None):
    """The newest finished run of ``stage`` whose outputs had ``digest`` (any parent, or none: a flow,
    ``dvc repro`` or ``dvc exp run``), or None."""
    if not digest:
        return None
    found = client.search_runs([exp_id], filter_string=f"tags.`{OUTPUTS_TAG}` = '{digest}' and "
                                                       f"tags.`{STAGE_TAG}` = '{stage}' and attributes.status = 'FINISHED'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    return found[0] if found else None


def _end_pipeline_run(client, run_id: str, status: str, reused: dict[str, str | None]) -> None:
    from mlflow.entities import Metric, RunTag

    parent = client.get_run(run_id)
    exp_id = parent.info.experiment_id
    latest: dict[str, float] = {}
    tags = []
    for stage, digest in reused.items():  # what DVC let this run use without running the stage
        source = producer_run(client, exp_id, stage, digest)
        tags.append(RunTag(REUSED_TAG + stage, source.info.run_id if source else "unknown (no run tagged "
                                                                                  "with these outputs)"))
        if source is not None:
            latest.update(source.data.metrics)
    children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'",
                                  order_by=["attributes.start_time ASC"])
    for child in children:  # a re-run stage overwrites an earlier one
        latest.update(child.data.metrics)
    if tags:
        with contextlib.suppress(Exception):
            client.log_batch(run_id, tags=tags)
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


def _open_stage_run(client, exp_id: str, cfg: Config, stage: str) -> str:
    parent_id = os.environ.get(PARENT_RUN_ENV) or None
    close_stale_runs(client, exp_id, tracking_uri(cfg))
    tags = {**_base_tags("stage"), STAGE_TAG: stage}
    if parent_id:  # the commit when the pipeline started, not now
        parent = client.get_run(parent_id)
        tags["mlflow.parentRunId"] = parent_id
        tags.update({k: v for k, v in parent.data.tags.items()
                     if k in (COMMIT_TAG, "grpo.dirty", "grpo.experiment", "dvc.exp_name")})
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
        if digest := outputs_digest(stage):  # what this run produced, for runs that later reuse it
            log.set_tags({OUTPUTS_TAG: digest})
        if stage in TRAINING_STAGES:
            log_checkpoint(log, cfg, stage)
        if stage == "evaluate":
            prefix = "eval/grpo/"
            grpo = {k[len(prefix):]: v for k, v in log.last.items() if k.startswith(prefix)}
            log._guard("tag_model", tag_model_with_eval, cfg, grpo)
    except BaseException as exc:
        log.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", STOPPED_END_TIMEOUT_S)
        raise
    # bounded: a lagging server costs at most END_TIMEOUT_S here, a dead one seconds; what it did not
    # take (the run's end among it) is saved, and the next run here makes it
    log.end("FINISHED", END_TIMEOUT_S)
