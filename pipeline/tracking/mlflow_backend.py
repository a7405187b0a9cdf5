"""MLflow adapter behind :mod:`pipeline.tracking`: the only module that imports the MLflow SDK.

Run layout: one *parent* run per pipeline execution, one nested *stage* run per stage execution
(MLflow's ``mlflow.parentRunId`` tag), so the UI shows ``pipeline -> prepare, sft, warmup, grpo, evaluate``.

How a stage finds its parent (every stage may be a separate process, e.g. under ``dvc repro``):

1. ``GRPO_PARENT_RUN_ID`` set (the Prefect flow creates the parent and exports its id to its
   tasks): use that run; the flow ends it.
2. Otherwise the parent is keyed by a tag ``pipeline_run`` = hash(effective config, git commit,
   DVC experiment name). A stage reuses the newest parent with that key that is not FINISHED
   (a crashed or killed run re-run with the same params continues in the same parent), or creates
   one. The last stage (``evaluate``) marks the parent FINISHED, so the next ``dvc repro`` with the
   same params starts a fresh parent. A changed param gives a new key, hence a new parent holding
   just the stages DVC re-ran.

Failure policy: the tracking backend is probed when a stage starts, *before* any training; an
unreachable server raises :class:`TrackingUnavailableError` (an ``InputError``: one line, exit 2)
naming the URI and how to turn tracking off. A failure while logging later warns once and turns
off calls of the same kind (metrics, tables, artifacts, tags) for that stage: training is never
lost for the sake of a metric, and a broken artifact store does not take the metrics with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.config import STAGES, Config
from pipeline.errors import InputError
from pipeline.tracking import FLOW_RUN_ENV, TrackingUnavailableError, temporary_env
from pipeline.tracking import PARENT_RUN_ENV as PARENT_ENV

PROBE_TIMEOUT_S = 5.0
ROLE_TAG = "grpo.role"  # "pipeline" on parents, "stage" on nested stage runs
KEY_TAG = "pipeline_run"


# --------------------------------------------------------------------------- helpers

def tracking_uri(cfg: Config) -> str:
    """The effective tracking URI: ``MLFLOW_TRACKING_URI`` wins over ``tracking.uri``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.uri


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


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _no_http_retries():
    """Make MLflow's REST calls fail fast (its defaults retry with backoff for minutes)."""
    return temporary_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(PROBE_TIMEOUT_S))})


def experiment_id(cfg: Config, client=None) -> str:
    """Id of ``cfg.tracking.experiment``, created if missing; fails fast if the backend is down."""
    uri = tracking_uri(cfg)
    probe(uri)
    client = client or _client(uri)
    try:
        with _no_http_retries():
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            if exp is None:
                return client.create_experiment(cfg.tracking.experiment)
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
    except InputError:
        raise
    except Exception as exc:  # any backend failure here happens before training: report it in one line
        if "already exists" in str(exc):  # created concurrently by another stage process
            return client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None


def git_commit(cwd: str | Path = ".") -> str | None:
    """HEAD commit of the working directory's git repo, with ``-dirty`` if tracked files changed."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, check=False, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=False, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _md5_path(path: Path) -> str | None:
    """md5 of a file, or of a folder's (relative name, md5) list; None if missing."""
    if path.is_file():
        h = hashlib.md5()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    if path.is_dir():
        items = [(str(p.relative_to(path)), _md5_path(p)) for p in sorted(path.rglob("*"))
                 if p.is_file() and "__pycache__" not in p.parts]
        return hashlib.md5(json.dumps(items).encode()).hexdigest()
    return None


def dvc_tags(stage: str, cfg: Config, root: str | Path = ".") -> dict[str, str]:
    """Tags tying a stage run to DVC: stage name, experiment, and hashes of the stage's inputs.

    ``dvc.inputs_md5`` hashes the stage's params sections and its deps as ``dvc.yaml`` lists them;
    a dep that an upstream stage produced takes the md5 recorded in ``dvc.lock`` (fresh: DVC writes
    the lock after each stage), anything else (code) is hashed here. ``dvc.lock_md5`` is the md5 of
    ``dvc.lock`` when the stage started.
    """
    import yaml

    root = Path(root)
    tags: dict[str, str] = {}
    for env, tag in (("DVC_STAGE", "dvc.stage"), ("DVC_EXP_NAME", "dvc.exp_name"),
                     ("DVC_EXP_BASELINE_REV", "dvc.exp_baseline_rev")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    lock_path, yaml_path = root / "dvc.lock", root / "dvc.yaml"
    if not lock_path.is_file():
        return tags
    try:
        tags["dvc.lock_md5"] = _md5_path(lock_path) or ""
        lock = yaml.safe_load(lock_path.read_text()) or {}
        spec = (yaml.safe_load(yaml_path.read_text()) or {}).get("stages", {}).get(stage) if yaml_path.is_file() else None
    except (OSError, yaml.YAMLError):
        return tags
    if not spec:
        return tags
    produced = {o["path"]: o.get("md5") for s in lock.get("stages", {}).values() for o in s.get("outs", [])}
    sections = cfg.to_dict()
    inputs = {"params": {p: sections.get(p) for p in spec.get("params", []) if isinstance(p, str)}}
    for dep in spec.get("deps", []):
        inputs[dep] = produced.get(dep) or _md5_path(root / dep)
    tags["dvc.inputs_md5"] = hashlib.md5(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return tags


def pipeline_key(cfg: Config, commit: str | None) -> str:
    """Key of one pipeline execution for processes that share no memory (e.g. ``dvc repro``)."""
    blob = json.dumps({"config": cfg.flat(), "git": commit, "exp": os.environ.get("DVC_EXP_NAME")},
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _params(cfg: Config) -> dict[str, str]:
    return {k: str(v)[:6000] for k, v in cfg.flat().items()}


def _log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Log params, skipping those the run already has (MLflow params are write-once)."""
    from mlflow.entities import Param

    have = client.get_run(run_id).data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i:i + 100])


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def runtime_tags() -> dict[str, str]:
    """What a run's floating-point results depend on beyond code, params and data.

    Runs are bit-identical on one machine, not across machines: torch picks its vector kernels
    (``env.cpu_kernels``: AVX2, AVX512, ...) and MKL its GEMM code path from the CPU, which changes
    the order of floating-point sums. Measured (docs/tuning.md, session 6): the 2000-step SFT landed
    at 70.5% held-out greedy on one 2-core machine and 81.0% on another, same code, params and
    wheel; on one machine, ``ATEN_CPU_CAPABILITY=avx2`` instead of the AVX512 default changed its
    logged loss from step 200 on (1.8929 against 1.8927) and its end point. ``ATEN_CPU_CAPABILITY``
    and ``MKL_CBWR`` are recorded when set.
    """
    import platform

    import torch

    tags = {"env.torch": torch.__version__, "env.python": platform.python_version(),
            "env.cpu_kernels": torch.backends.cpu.get_cpu_capability(), "env.machine": platform.machine()}
    if model := cpu_model():
        tags["env.cpu"] = model
    if torch.version.cuda:
        tags["env.cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never the first CUDA call (fork safety)
        tags["env.cuda_device"] = torch.cuda.get_device_name(torch.cuda.current_device())
    for var in ("ATEN_CPU_CAPABILITY", "MKL_CBWR"):
        if os.environ.get(var):
            tags[f"env.{var}"] = os.environ[var]
    return tags


def _common_tags(cfg: Config) -> dict[str, str]:
    tags = {"git.commit": git_commit() or "unknown", **runtime_tags()}
    if os.environ.get(FLOW_RUN_ENV):
        tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
    return tags


# --------------------------------------------------------------------------- parent runs

def start_pipeline_run(cfg: Config, name: str | None = None, tags: dict[str, str] | None = None) -> str:
    """Create a parent run explicitly (used by the Prefect flow); returns its id."""
    uri = tracking_uri(cfg)
    client = _client(uri)
    exp_id = experiment_id(cfg, client)
    all_tags = {ROLE_TAG: "pipeline", **_common_tags(cfg), **(tags or {})}
    run = client.create_run(exp_id, tags=all_tags, run_name=name or "pipeline")
    _log_params(client, run.info.run_id, _params(cfg))
    return run.info.run_id


def end_pipeline_run(cfg: Config, run_id: str, status: str = "FINISHED") -> None:
    """Mark a parent run FINISHED / FAILED / KILLED."""
    _client(tracking_uri(cfg)).set_terminated(run_id, status=status)


def _find_or_create_parent(client, exp_id: str, cfg: Config) -> tuple[str, bool]:
    """(parent run id, owned): ``owned`` is True when this module manages its lifecycle."""
    env_parent = os.environ.get(PARENT_ENV)
    if env_parent:
        return env_parent, False
    commit = git_commit()
    key = pipeline_key(cfg, commit)
    found = client.search_runs(
        [exp_id], filter_string=f"tags.{KEY_TAG} = '{key}' and attributes.status != 'FINISHED'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if found:
        run_id = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return run_id, True
    tags = {ROLE_TAG: "pipeline", KEY_TAG: key, **_common_tags(cfg)}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    run = client.create_run(exp_id, tags=tags, run_name=f"pipeline-{key[:8]}")
    _log_params(client, run.info.run_id, _params(cfg))
    return run.info.run_id, True


# --------------------------------------------------------------------------- stage logger

class MlflowLogger:
    """:class:`pipeline.tracking.Logger` writing to one MLflow run through an explicit client
    (no fluent global state, so concurrent Prefect task threads cannot mix runs up)."""

    def __init__(self, client, run_id: str, uri: str):
        self.client, self.run_id, self.uri = client, run_id, uri
        self._broken: set[str] = set()

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        """Call `fn`; if it fails, warn once and skip calls of the same kind for the rest of the stage.
        Training never stops for tracking, and a failing artifact call does not stop the metrics."""
        if what in self._broken:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._broken.add(what)
            msg = " ".join(str(exc).split())[:200]
            print(f"warning: MLflow {what} failed on {self.uri} ({type(exc).__name__}: {msg}); "
                  f"{what} disabled for the rest of this stage", file=sys.stderr)

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
        if items:
            self._guard("log_metrics", self.client.log_batch, self.run_id, metrics=items)

    def log_artifact(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            self._guard("log_artifacts", self.client.log_artifacts, self.run_id, str(path), path.name)
        else:
            self._guard("log_artifact", self.client.log_artifact, self.run_id, str(path))

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Rows to a JSON table artifact; a second call with the same name appends to it. Log many
        small tables under one name: MLflow lists every table name in a run tag that holds 8,000
        characters, so about 145 distinct names break log_table for the run (mlflow#11874, #13170)."""
        import pandas as pd

        artifact = name if name.endswith(".json") else f"{name}.json"
        # Appending downloads the table first, and MLflow draws a progress bar for that download on
        # stderr: one per logged iteration in the stage's output. Off unless the user asked for it.
        bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
        with temporary_env({bar: os.environ.get(bar) or "false"}):
            self._guard("log_table", self.client.log_table, self.run_id, pd.DataFrame(rows), artifact)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._guard("set_tags", self.client.log_batch, self.run_id,
                    tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


@contextlib.contextmanager
def mlflow_stage_logger(cfg: Config, stage: str) -> Iterator[MlflowLogger]:
    """A nested stage run under the pipeline's parent; fails fast (before training) if unreachable."""
    uri = tracking_uri(cfg)
    client = _client(uri)
    exp_id = experiment_id(cfg, client)  # probe: raises TrackingUnavailableError in seconds
    try:
        with _no_http_retries():
            parent_id, owned = _find_or_create_parent(client, exp_id, cfg)
            tags = {"mlflow.parentRunId": parent_id, ROLE_TAG: "stage", "grpo.stage": stage,
                    **_common_tags(cfg), **dvc_tags(stage, cfg)}
            run = client.create_run(exp_id, tags=tags, run_name=stage)
    except Exception as exc:
        raise _unavailable(uri, f"{type(exc).__name__}: {exc}") from None
    log = MlflowLogger(client, run.info.run_id, uri)
    log.log_params(_params(cfg))
    try:
        yield log
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):
            client.set_terminated(run.info.run_id, status=status)
            if owned:
                client.set_terminated(parent_id, status=status)
        raise
    with contextlib.suppress(Exception):
        client.set_terminated(run.info.run_id, status="FINISHED")
        if owned and stage == STAGES[-1]:
            client.set_terminated(parent_id, status="FINISHED")


# --------------------------------------------------------------------------- comparison

KEY_METRIC_WORDS = ("reward", "kl", "informative", "accuracy", "loss", "format_rate", "pass@", "maj@")
DEFAULT_KEY_PARAMS = ("model.backend", "model.n_embd", "sft.steps", "warmup.iterations", "grpo.iterations",
                      "grpo.kl_coef", "grpo.lr", "grpo.group_size", "grpo.loss_agg", "grpo.adv_norm")


def _key_metric(name: str) -> bool:
    metric = name.split(":", 1)[-1].rsplit("/", 1)[-1]
    return any(w in metric for w in KEY_METRIC_WORDS) and not metric.endswith("_std")


def runs_table(cfg: Config, max_runs: int = 10, all_metrics: bool = False):
    """DataFrame, one column per pipeline run (newest first): params that differ, final metrics.

    Rows are ``param:<section.key>`` and ``<stage>:<metric>`` (the last logged value of each
    metric of each stage run), like MLflow's compare view; only the headline metrics (reward, kl,
    informative, accuracy, loss, format rate, pass@k/maj@k) unless ``all_metrics``.
    """
    import pandas as pd

    uri = tracking_uri(cfg)
    client = _client(uri)
    exp_id = experiment_id(cfg, client)
    parents = client.search_runs([exp_id], filter_string=f"tags.`{ROLE_TAG}` = 'pipeline'",
                                 order_by=["attributes.start_time DESC"], max_results=max_runs)
    columns: dict[str, dict[str, Any]] = {}
    all_params: dict[str, dict[str, str]] = {}
    for p in parents:
        rid = p.info.run_id
        col_name = f"{p.info.run_name or rid[:8]} ({rid[:6]})"
        col: dict[str, Any] = {"status": p.info.status,
                               "started": pd.Timestamp(p.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M")}
        all_params[col_name] = p.data.params
        children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{rid}'",
                                      order_by=["attributes.start_time ASC"])
        for child in children:  # later executions of a stage (resumes) overwrite earlier ones
            stage = child.data.tags.get("grpo.stage", child.info.run_name)
            for key, value in child.data.metrics.items():
                if all_metrics or _key_metric(key):
                    col[f"{stage}:{key}"] = value
        columns[col_name] = col
    if not columns:
        return pd.DataFrame()
    keys = sorted({k for ps in all_params.values() for k in ps})
    differing = [k for k in keys if len({ps.get(k) for ps in all_params.values()}) > 1]
    shown = differing or [k for k in DEFAULT_KEY_PARAMS if k in keys]
    for name, col in columns.items():
        for k in shown:
            col[f"param:{k}"] = all_params[name].get(k)
    df = pd.DataFrame(columns)
    order = (["status", "started"] + [f"param:{k}" for k in shown]
             + sorted(i for i in df.index if i not in {"status", "started"} and not i.startswith("param:")))
    return df.reindex(order)


def compare_text(cfg: Config, max_runs: int = 10, all_metrics: bool = False) -> str:
    import pandas as pd

    df = runs_table(cfg, max_runs, all_metrics)
    uri = tracking_uri(cfg)
    if df.empty:
        return f"no pipeline runs in experiment {cfg.tracking.experiment!r} at {uri}"
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.max_colwidth", 40, "display.float_format", "{:.4g}".format):
        return (f"experiment {cfg.tracking.experiment!r} at {uri}: {df.shape[1]} pipeline run(s), "
                f"newest first\n{df.to_string(na_rep='-')}")

