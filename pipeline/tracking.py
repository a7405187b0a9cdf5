"""Metrics go through one small logger interface; the MLflow SDK is imported inside its adapter.

Stages do::

    with stage_logger(cfg, "grpo") as log:
        log.log_params(...); log.log_metrics({"train/reward": r}, step=it)

Metric names are namespaced: ``train/reward``, ``train/kl``, ``train/informative``, ``eval/...``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from pipeline.config import Config


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
