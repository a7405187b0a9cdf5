"""Prefect tasks: one thin, typed task per pipeline stage, wrapping the same function the CLI and DVC call.

Each task takes the params file and ``section.key=value`` overrides (small, readable inputs in the
Prefect UI), loads the config itself, runs ``pipeline.stages.stage_function(name)`` and returns the
stage's small JSON-serialisable dict (paths and headline figures), never tensors.

Retries are declared here and only here, and only for failures that can be transient:

- ``prepare`` retries a failed dataset download (network errors) and an unreachable tracking server;
- the training and evaluation stages retry only an unreachable tracking server, which is detected
  before any training starts. A crashed training task is *not* retried: re-running the flow resumes it
  from ``checkpoints/<stage>.resume``.

Caching is off (``NO_CACHE``): stage outputs live on disk and DVC is the cache; a Prefect result cache
would skip a stage whose checkpoint was deleted.

The Prefect flow-run id and the MLflow parent run reach ``pipeline.tracking`` through environment
variables (``GRPO_PREFECT_FLOW_RUN_ID``, ``GRPO_PARENT_RUN_ID``): ``pipeline/`` never imports prefect.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from pipeline.config import STAGES, load_config
from pipeline.stages import stage_function
from pipeline.tracking import (FLOW_RUN_ENV, PARENT_RUN_ENV, TrackingUnavailableError, end_pipeline_run,
                               start_pipeline_run, temporary_env)

RETRY_DELAYS_S = [5, 30]
TRANSIENT_NAMES = {"ConnectionError", "Timeout", "ConnectTimeout", "ReadTimeout", "ConnectTimeoutError",
                   "ReadTimeoutError", "NewConnectionError", "MaxRetryError", "RemoteDisconnected",
                   "ChunkedEncodingError", "IncompleteRead", "ProtocolError", "HfHubHTTPError",
                   "ServerDisconnectedError", "ClientConnectorError", "gaierror"}


# --------------------------------------------------------------------------- retry conditions

def _exception(state: State) -> BaseException | None:
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as err:  # the result itself could not be read: judge by that error
        return err
    return exc if isinstance(exc, BaseException) else None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """The exception, then its causes/contexts (a stage may wrap a network error in an InputError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_tracking_outage(exc: BaseException | None) -> bool:
    return any(isinstance(e, TrackingUnavailableError) for e in _chain(exc))


def is_network_error(exc: BaseException | None) -> bool:
    """Connection resets, timeouts, DNS failures and 5xx-style hub errors: worth another try."""
    return any(isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in TRANSIENT_NAMES
               for e in _chain(exc))


def retry_on_tracking_outage(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry only when the tracking server was unreachable (raised before any training started)."""
    return is_tracking_outage(_exception(state))


def retry_on_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry a dataset download or tracking server that failed for a reason that may pass."""
    exc = _exception(state)
    return is_tracking_outage(exc) or is_network_error(exc)


# --------------------------------------------------------------------------- helpers

def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def tracking_env(parent_run_id: str | None):
    """Export the MLflow parent run and Prefect flow-run id to ``pipeline.tracking`` for one stage."""
    return temporary_env({PARENT_RUN_ENV: parent_run_id, FLOW_RUN_ENV: _flow_run_id()})


def run_stage(name: str, params_path: str, overrides: list[str] | None,
              parent_run_id: str | None = None) -> dict[str, Any]:
    """Load the config and run one stage, as ``python -m pipeline <name>`` does."""
    cfg = load_config(params_path, list(overrides or []))
    with tracking_env(parent_run_id):
        result = stage_function(name)(cfg) or {}
    return json.loads(json.dumps({"stage": name, **result}, default=str))  # small, JSON-only


# --------------------------------------------------------------------------- tracking tasks

@task(name="open-tracking", retries=2, retry_delay_seconds=RETRY_DELAYS_S,
      retry_condition_fn=retry_on_tracking_outage, cache_policy=NO_CACHE)
def open_tracking(params_path: str, overrides: list[str] | None = None, run_name: str | None = None) -> str | None:
    """Create the MLflow parent run of this flow run; None when tracking is disabled."""
    cfg = load_config(params_path, list(overrides or []))
    flow_run_id = _flow_run_id()
    tags = {"prefect.flow_run_id": str(flow_run_id)} if flow_run_id else {}
    return start_pipeline_run(cfg, name=run_name, tags=tags)


@task(name="close-tracking", retries=2, retry_delay_seconds=RETRY_DELAYS_S,
      retry_condition_fn=retry_on_tracking_outage, cache_policy=NO_CACHE)
def close_tracking(params_path: str, overrides: list[str] | None, parent_run_id: str | None,
                   status: str = "FINISHED") -> None:
    """Mark the flow's MLflow parent run FINISHED or FAILED."""
    end_pipeline_run(load_config(params_path, list(overrides or [])), parent_run_id, status)


# --------------------------------------------------------------------------- stage tasks

@task(name="prepare", retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_on_transient,
      cache_policy=NO_CACHE)
def prepare(params_path: str, overrides: list[str] | None = None, parent_run_id: str | None = None) -> dict[str, Any]:
    """Download/validate GSM8K, build the arithmetic curriculum, train the tokenizer."""
    return run_stage("prepare", params_path, overrides, parent_run_id)


@task(name="sft", retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_on_tracking_outage,
      cache_policy=NO_CACHE)
def sft(params_path: str, overrides: list[str] | None = None, parent_run_id: str | None = None) -> dict[str, Any]:
    """Supervised fine-tuning into checkpoints/sft."""
    return run_stage("sft", params_path, overrides, parent_run_id)


@task(name="warmup", retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_on_tracking_outage,
      cache_policy=NO_CACHE)
def warmup(params_path: str, overrides: list[str] | None = None, parent_run_id: str | None = None) -> dict[str, Any]:
    """GRPO on the arithmetic curriculum into checkpoints/warmup (resumes from warmup.resume)."""
    return run_stage("warmup", params_path, overrides, parent_run_id)


@task(name="grpo", retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_on_tracking_outage,
      cache_policy=NO_CACHE)
def grpo(params_path: str, overrides: list[str] | None = None, parent_run_id: str | None = None) -> dict[str, Any]:
    """GRPO on GSM8K into checkpoints/grpo (resumes from grpo.resume)."""
    return run_stage("grpo", params_path, overrides, parent_run_id)


@task(name="evaluate", retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_on_tracking_outage,
      cache_policy=NO_CACHE)
def evaluate(params_path: str, overrides: list[str] | None = None, parent_run_id: str | None = None) -> dict[str, Any]:
    """Score the configured checkpoints; write metrics/eval.json, reports/ and plots/."""
    return run_stage("evaluate", params_path, overrides, parent_run_id)


STAGE_TASKS: dict[str, Task] = {"prepare": prepare, "sft": sft, "warmup": warmup, "grpo": grpo,
                                "evaluate": evaluate}
assert tuple(STAGE_TASKS) == STAGES, "one task per stage, in pipeline order"
