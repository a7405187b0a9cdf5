"""Metrics go through one small logger interface; the MLflow SDK is imported inside its adapter.

Stages do::

    with stage_logger(cfg, "grpo") as log:
        log.log_params(...); log.log_metrics({"train/reward": r}, step=it)

Metric names are namespaced by stage: a stage logger turns the trainer's generic ``train/`` prefix
into the stage's name, so warmup logs ``warmup/reward`` and grpo ``grpo/kl``; sft logs ``sft/...``,
control ``control/...`` and evaluation ``eval/<checkpoint>/...``.

Imports go one way: this facade -> :mod:`pipeline.tracking.mlflow_backend` (the adapter, imported
lazily, only when tracking is on) -> :mod:`pipeline.tracking.common`; :mod:`pipeline.tracking.compare`
sits beside the facade. Run layout and lineage: see the adapter's docstring and docs/orchestration.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from pipeline.core.config import Config
from pipeline.tracking.common import (FLOW_RUN_ENV, PARENT_RUN_ENV, RUN_NAME_ENV, TrackingUnavailableError,
                                      git_state, resolve_uri, run_name, temporary_env)

__all__ = ["FLOW_RUN_ENV", "PARENT_RUN_ENV", "RUN_NAME_ENV", "Logger", "NullLogger", "TrackingUnavailableError",
           "end_pipeline_run", "git_state", "resolve_uri", "run_link", "run_name", "stage_logger",
           "start_pipeline_run", "temporary_env"]


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


class StageNamespace:
    """A :class:`Logger` that files the generic ``train/`` metrics under the stage's name."""

    def __init__(self, inner: Logger, stage: str):
        self.inner, self.stage = inner, stage

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        named = {f"{self.stage}/{k[len('train/'):]}" if k.startswith("train/") else k: v for k, v in metrics.items()}
        self.inner.log_metrics(named, step)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextlib.contextmanager
def stage_logger(cfg: Config, stage: str, enabled: bool = True) -> Iterator[Logger]:
    """A logger for one stage run (nested under the pipeline's parent run when there is one)."""
    if not (enabled and cfg.tracking.enabled):
        yield NullLogger()
        return
    from pipeline.tracking.mlflow_backend import mlflow_stage_logger  # SDK imported only here

    with mlflow_stage_logger(cfg, stage) as log:
        yield StageNamespace(log, stage)


def start_pipeline_run(cfg: Config, name: str | None = None, tags: dict[str, str] | None = None) -> str | None:
    """Open the parent run of one pipeline execution; None when tracking is off. Its id goes to the
    stages in ``GRPO_PARENT_RUN_ID``. Raises ``TrackingUnavailableError`` in seconds if the backend
    is down; marks KILLED the runs a killed process left RUNNING on this host."""
    if not cfg.tracking.enabled:
        return None
    from pipeline.tracking.mlflow_backend import start_pipeline_run as _start

    return _start(cfg, name=name, tags=tags)


def end_pipeline_run(cfg: Config, run_id: str | None, status: str = "FINISHED",
                     reused: dict[str, str | None] | None = None) -> None:
    """Close the parent run (FINISHED, FAILED or KILLED), with the stages' final metrics on it; those of
    the stages DVC skipped come from the runs that produced the outputs used (``reused``: {stage:
    :func:`pipeline.tracking.common.outputs_digest`})."""
    if not run_id or not cfg.tracking.enabled:
        return
    from pipeline.tracking.mlflow_backend import end_pipeline_run as _end

    _end(cfg, run_id, status, reused)


def run_link(cfg: Config, parent_id: str | None, stage: str) -> str | None:
    """Where to open the newest MLflow run of ``stage`` (under ``parent_id``); None without one."""
    if not cfg.tracking.enabled:
        return None
    from pipeline.tracking.mlflow_backend import run_link as _link

    return _link(cfg, parent_id, stage)
