"""Metrics go through one small logger interface; the MLflow SDK is imported inside its adapter.

Stages do::

    with stage_logger(cfg, "grpo") as log:
        log.log_params(...); log.log_metrics({"train/reward": r}, step=it)

Metric names are namespaced: ``train/reward``, ``train/kl``, ``train/informative``, ``eval/...``.

Run layout and the parent-run scheme (one parent run per pipeline execution, one nested run per
stage, found across ``dvc repro`` processes) are documented in :mod:`pipeline.tracking_mlflow`.
Orchestrators pass context through environment variables, never imports: ``GRPO_PARENT_RUN_ID``
(the parent run a flow created) and ``GRPO_PREFECT_FLOW_RUN_ID`` (tagged on every run).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from pipeline.config import Config
from pipeline.errors import InputError


@contextlib.contextmanager
def temporary_env(values: dict[str, str | None]) -> Iterator[None]:
    """Set environment variables (None or "" leaves one unset) for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items() if v})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Logger(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def log_table(self, rows: list[dict[str, Any]], name: str) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...


class NullLogger:
    """Drops everything: for tests, non-zero ranks and `tracking.enabled: false`."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass


@contextlib.contextmanager
def stage_logger(cfg: Config, stage: str, enabled: bool = True) -> Iterator[Logger]:
    """A logger for one stage run (nested under the pipeline's parent run when there is one)."""
    if not (enabled and cfg.tracking.enabled):
        yield NullLogger()
        return
    from pipeline.tracking_mlflow import mlflow_stage_logger  # SDK imported only here

    with mlflow_stage_logger(cfg, stage) as log:
        yield log


class TrackingUnavailableError(InputError):
    """The MLflow tracking backend cannot be reached; raised before any training starts."""


PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
FLOW_RUN_ENV = "GRPO_PREFECT_FLOW_RUN_ID"


def start_pipeline_run(cfg: Config, name: str | None = None, tags: dict[str, str] | None = None) -> str | None:
    """Open a parent run for one pipeline execution (a flow run); None when tracking is off.

    Raises ``TrackingUnavailableError`` (an ``InputError``) within seconds if the backend is down.
    """
    if not cfg.tracking.enabled:
        return None
    from pipeline.tracking_mlflow import start_pipeline_run as _start

    return _start(cfg, name=name, tags=tags)


def end_pipeline_run(cfg: Config, run_id: str | None, status: str = "FINISHED") -> None:
    """Close the parent run opened by :func:`start_pipeline_run` (FINISHED, FAILED or KILLED)."""
    if run_id is None or not cfg.tracking.enabled:
        return
    from pipeline.tracking_mlflow import end_pipeline_run as _end

    _end(cfg, run_id, status)


def compare_runs(cfg: Config, max_runs: int = 10, all_metrics: bool = False) -> str:
    """The experiment's pipeline runs side by side (params that differ, final metrics per stage).

    The CLI counterpart of MLflow's compare view: ``python -m pipeline compare``. Works with
    ``tracking.enabled: false`` too (it only reads), so smoke configs can list their runs.
    """
    from pipeline.tracking_mlflow import compare_text

    return compare_text(cfg, max_runs, all_metrics)
