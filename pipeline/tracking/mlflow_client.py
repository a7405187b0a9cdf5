"""The MLflow connection behind :mod:`pipeline.tracking`: URIs refused at once, the probe, the
client, the experiment, and the tag names the adapter shares (see :mod:`pipeline.tracking.mlflow_backend`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.core.config import Config
from pipeline.core.errors import InputError
from pipeline.tracking.common import TrackingUnavailableError, resolve_uri, temporary_env


PROBE_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 10.0  # the default bound of MlflowLogger.flush
# The most a finished stage waits for a server that answers but lags to take its queued calls (its
# last metrics, checkpoint, the run's end); after that they are saved and a later run makes them.
END_TIMEOUT_S = float(os.environ.get("GRPO_TRACKING_END_TIMEOUT_S") or 120.0)
STOPPED_END_TIMEOUT_S = 5.0  # the same for a failed or interrupted stage: a stop must be prompt
PROGRESS_S = 10.0  # a line on stderr this often while a stage waits on the server at its end
PENDING_TIMEOUT_S = 30.0  # the most a run's start spends making the calls earlier runs saved
ROLE_TAG = "grpo.role"  # "pipeline" on parents, "stage" on stage runs
STAGE_TAG = "grpo.stage"
WORKSPACE_TAG = "grpo.workspace"
HOST_TAG, PID_TAG = "grpo.host", "grpo.pid"  # the process that owns a RUNNING run
COMMIT_TAG = "mlflow.source.git.commit"
CHECKPOINT_TAG = "grpo.checkpoint_sha256"
OUTPUTS_TAG = "grpo.outputs"  # common.outputs_digest of the stage's DVC outs, on its finished run
REUSED_TAG = "grpo.reused."  # + stage, on a parent: the run whose outputs it used where DVC skipped the stage
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
