"""The stage logger: one logging thread per MLflow run and its failure policy (see
:mod:`pipeline.tracking.mlflow_backend`), and the calls a run could not deliver in time, saved for
a later run to make (:func:`save_pending`, :func:`load_pending`).
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.files import write_bytes_atomic
from pipeline.core.lock import pid_alive
from pipeline.tracking.common import TrackingUnavailableError, repo_root, temporary_env
from pipeline.tracking.mlflow_client import (END_TIMEOUT_S, FLUSH_TIMEOUT_S, PROGRESS_S, _log_params, _unreachable,
                                             probe)

PENDING_DIR = Path("mlruns") / "pending"  # under the repository root (git-ignored): one file per run


# the functions a saved call may name (module:name): a saved file is data, never code to import at will
SAVABLE_FUNCS = frozenset({
    "pipeline.tracking.mlflow_logger:_log_params_of",
    "pipeline.tracking.mlflow_logger:_log_table_quietly",
    "pipeline.tracking.mlflow_models:_register_uploaded",
    "pipeline.tracking.mlflow_models:_log_model",
})
# the client methods a saved call may name
SAVABLE_METHODS = frozenset({"log_batch", "log_artifact", "log_artifacts", "log_table", "set_terminated"})


@dataclass(frozen=True)
class WithLogger:
    """A queued call of a module-level function that takes the logger first. Unlike a closure it is
    saved by its name (one of SAVABLE_FUNCS), so a call the server did not take in time can be saved."""

    func: Callable[..., Any]


class ClientMethod:
    """A method of the run's client, bound when the call is queued and saved by its name only, so
    a later process making the saved call binds it to its own client."""

    def __init__(self, name: str, bound: Callable[..., Any] | None = None):
        self.name, self.bound = name, bound


# ---- saved calls as JSON: plain data plus the few MLflow types the logger queues, tagged by type

def _encode(obj: Any) -> Any:
    """`obj` as JSON data; TypeError for anything the logger does not queue (such a call is not saved)."""
    from mlflow.entities import Metric, RunTag

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_encode(x) for x in obj]
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"dict": {k: _encode(v) for k, v in obj.items()}}
    if isinstance(obj, Metric):
        return {"metric": [obj.key, obj.value, obj.timestamp, obj.step]}
    if isinstance(obj, RunTag):
        return {"tag": [obj.key, obj.value]}
    if isinstance(obj, ClientMethod) and obj.name in SAVABLE_METHODS:
        return {"client": obj.name}
    if isinstance(obj, WithLogger):
        name = f"{obj.func.__module__}:{obj.func.__qualname__}"
        if name in SAVABLE_FUNCS:
            return {"with_logger": name}
    if type(obj).__name__ == "DataFrame":
        return {"frame": json.loads(obj.to_json(orient="records"))}
    raise TypeError(f"a queued {type(obj).__name__} is not saved")


def _decode(obj: Any) -> Any:
    """The inverse of :func:`_encode`; ValueError for anything else (a file that is not ours)."""
    from mlflow.entities import Metric, RunTag

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(x) for x in obj]
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise ValueError(f"not a saved value: {str(obj)[:80]}")
    (kind, value), = obj.items()
    if kind == "dict" and isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if kind == "metric":
        key, val, ts, step = value
        return Metric(str(key), float(val), int(ts), int(step))
    if kind == "tag":
        return RunTag(str(value[0]), str(value[1]))
    if kind == "client" and value in SAVABLE_METHODS:
        return ClientMethod(value)
    if kind == "with_logger" and value in SAVABLE_FUNCS:
        module, _, name = value.partition(":")
        return WithLogger(getattr(importlib.import_module(module), name))
    if kind == "frame" and isinstance(value, list):
        import pandas as pd

        return pd.DataFrame(value)
    raise ValueError(f"not a saved value: {kind}")


def _encode_call(call: tuple) -> list | None:
    """A queued (what, fn, args, kwargs) as JSON data, or None if it cannot be saved."""
    what, fn, args, kwargs = call
    try:
        fn = ClientMethod(fn) if isinstance(fn, str) else fn
        return [what, _encode(fn), _encode(list(args)), _encode(dict(kwargs))]
    except TypeError:
        return None


def _decode_call(data: Any) -> tuple:
    what, fn, args, kwargs = data
    fn, args, kwargs = _decode(fn), _decode(args), _decode(kwargs)
    if not (isinstance(what, str) and isinstance(fn, (ClientMethod, WithLogger)) and isinstance(args, list)
            and isinstance(kwargs, dict)):
        raise ValueError("not a saved call")
    return what, fn, tuple(args), kwargs


def _log_params_of(log: MlflowLogger, params: dict[str, Any]) -> None:
    _log_params(log.client, log.run_id, params)


def _log_table_quietly(log: MlflowLogger, log_table: ClientMethod, frame, artifact: str) -> None:
    """Appending downloads the table first, and MLflow draws a progress bar for that download on
    stderr: one per logged iteration in the stage's output. Off unless the user asked for it."""
    bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    with temporary_env({bar: os.environ.get(bar) or "false"}):
        log._resolve(log_table)(log.run_id, frame, artifact)


# --------------------------------------------------------------------------- stage logger

class MlflowLogger:
    """:class:`pipeline.tracking.Logger` writing to one MLflow run through an explicit client
    (no fluent global state, so concurrent Prefect task threads cannot mix runs up).

    Every call is queued for one logging thread: the training thread never waits on the server.
    A failing call warns once and turns off calls of its kind; a server that stops answering
    (connection refused, timeouts) warns once and turns all of them off. :meth:`close` waits at
    most FLUSH_TIMEOUT_S for what is queued, then gives up with one warning; :meth:`end` ends the
    run, waits longer for a server that answers, and saves what it could not deliver.

    A queued ``fn`` is a callable, a :class:`ClientMethod` (or its name) or a :class:`WithLogger`;
    the last two can be saved and made by another process (see :func:`save_pending`)."""

    def __init__(self, client, run_id: str, uri: str):
        self.client, self.run_id, self.uri = client, run_id, uri
        self._broken: set[str] = set()
        self._down = False  # the server stopped answering: everything is skipped
        self._down_lock = threading.Lock()
        self.last: dict[str, float] = {}  # the last value of every metric logged
        self._queue: queue.Queue = queue.Queue()
        self._unmade: collections.deque = collections.deque()  # queued calls not made yet, in order
        self._unmade_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=f"mlflow-{run_id[:8]}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            what, fn, args, kwargs = self._queue.get()
            if what == "__stop__":
                return
            if what == "__flush__":
                fn()
            elif self._call(what, self._resolve(fn), *args, **kwargs):
                with self._unmade_lock:
                    self._unmade.popleft()  # calls are made in queue order: this one was first

    def _resolve(self, fn):
        if isinstance(fn, str):
            return getattr(self.client, fn)
        if isinstance(fn, ClientMethod):
            return fn.bound or getattr(self.client, fn.name)
        if isinstance(fn, WithLogger):
            return lambda *args, **kwargs: fn.func(self, *args, **kwargs)
        return fn

    def _method(self, name: str) -> ClientMethod:
        return ClientMethod(name, getattr(self.client, name))

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        """Queue `fn(*args, **kwargs)` for the logging thread (skipped if its kind failed before);
        `fn` a callable, a :class:`ClientMethod` or a :class:`WithLogger`."""
        if not (self._down or what in self._broken):
            self._put((what, fn, args, kwargs))

    def _put(self, item: tuple) -> None:
        """Queue a call; once the server is down it is only kept (for :meth:`finish` to save)."""
        with self._unmade_lock:
            self._unmade.append(item)
        if not self._down:
            self._queue.put(item)

    def _call(self, what: str, fn, *args, **kwargs) -> bool:
        """Call `fn`; if it fails, warn once and skip calls of the same kind for the rest of the stage
        (all calls, if the server stopped answering). Training never stops for tracking. False when
        the call was not made for a server that is down (it stays for :meth:`finish` to save)."""
        if self._down:
            return False
        if what in self._broken:
            return True
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            msg = " ".join(str(exc).split())[:200]
            if _unreachable(exc) or not self._answers():
                self._mark_down(f"{type(exc).__name__}: {msg}")
                return False
            self._broken.add(what)
            print(f"warning: MLflow {what} failed on {self.uri} ({type(exc).__name__}: {msg}); "
                  f"{what} disabled for the rest of this stage", file=sys.stderr)
        return True

    def _mark_down(self, reason: str) -> None:
        """The server stopped answering: skip every call from now on; warn once (the logging thread
        and the end-of-stage flush can both find out)."""
        with self._down_lock:
            if self._down:
                return
            self._down = True
        print(f"warning: MLflow at {self.uri} stopped answering ({reason}); "
              "tracking is off for the rest of this stage, training goes on", file=sys.stderr)

    def _answers(self) -> bool:
        """After a failed call: does the server still answer its health check (2 s, no retries)?"""
        if not self.uri.startswith(("http://", "https://")):
            return True
        try:
            probe(self.uri, timeout=2.0)
        except TrackingUnavailableError:
            return False
        return True

    def flush(self, timeout: float = FLUSH_TIMEOUT_S, progress: bool = False) -> bool:
        """Wait up to `timeout` s for the queued calls; False (one warning, the rest dropped) if not
        done. A server whose health check fails is not waited for. With `progress` (:meth:`finish`),
        a line every PROGRESS_S s says how many calls are still queued and the health check is asked
        again; the caller then saves what is left instead of a warning that it is lost."""
        done = threading.Event()
        self._queue.put(("__flush__", done.set, (), {}))
        start = time.monotonic()
        deadline, probe_at = start + timeout, start + 0.5
        while not done.wait(0.05):
            now = time.monotonic()
            if self._down or now > deadline:  # a dead server: nothing left worth waiting for
                break
            # a call still pending after half a second may be sitting in the HTTP client's retries
            # against a server that is gone: ask its health check rather than wait them out
            if now >= probe_at:
                probe_at = now + PROGRESS_S if progress else float("inf")
                if progress and now - start >= PROGRESS_S:
                    print(f"MLflow at {self.uri} is slow: {len(self._unmade)} tracking calls still queued after "
                          f"{now - start:.0f} s (waiting at most {timeout:g} s)", file=sys.stderr)
                if not self._answers():
                    self._mark_down("no answer to its health check at the end of the stage")
        else:
            return True
        if not (self._down or progress):  # (with progress the caller saves what is left)
            print(f"warning: MLflow at {self.uri}: gave up after {timeout:g} s on {len(self._unmade)} "
                  "queued tracking calls; the run's last metrics may be missing", file=sys.stderr)
        self._down = True
        return False

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Flush (bounded by `timeout`), then stop the logging thread."""
        if self.flush(timeout):
            self._queue.put(("__stop__", None, (), {}))
            self._thread.join(timeout)

    def end(self, status: str, timeout: float = END_TIMEOUT_S) -> bool:
        """End the run (FINISHED, FAILED, KILLED): its end is queued behind everything else, even when
        tracking went off for this stage, then :meth:`finish`. True when the server took it all."""
        self._put(("set_terminated", "set_terminated", (self.run_id,), {"status": status}))
        return self.finish(timeout)

    def finish(self, timeout: float = END_TIMEOUT_S) -> bool:
        """Wait up to `timeout` s for the queued calls while the server answers, a progress line every
        PROGRESS_S s. What it has not made by then (or when a signal cuts the wait short) is saved
        for a later run (:func:`save_pending`) instead of dropped. True when all were made."""
        done = False
        try:
            done = not self._down and self.flush(timeout, progress=True)
        finally:
            self._down = True  # the logging thread makes no further call (but the one in flight)
            self._queue.put(("__stop__", None, (), {}))
            with self._unmade_lock:
                calls = [] if done else [c for c in self._unmade if c[0] not in self._broken]
            if calls:
                save_pending(self, calls)
        return done

    def log_params(self, params: dict[str, Any]) -> None:
        self._guard("log_params", WithLogger(_log_params_of), params)

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
            self._guard("log_metrics", self._method("log_batch"), self.run_id, metrics=items)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self._guard("log_artifacts", self._method("log_artifacts"), self.run_id, str(path.resolve()),
                        artifact_path or path.name)
        else:
            self._guard("log_artifact", self._method("log_artifact"), self.run_id, str(path.resolve()), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        """Rows to a JSON table artifact; a second call with the same name appends to it. Log many
        small tables under one name: MLflow lists every table name in a run tag that holds 8,000
        characters, so about 145 distinct names break log_table for the run (mlflow#11874, #13170)."""
        import pandas as pd

        artifact = name if name.endswith(".json") else f"{name}.json"
        self._guard("log_table", WithLogger(_log_table_quietly), self._method("log_table"), pd.DataFrame(rows), artifact)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._guard("set_tags", self._method("log_batch"), self.run_id,
                    tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


# --------------------------------------------------------------------------- calls saved for later

def pending_path(run_id: str) -> Path:
    return repo_root() / PENDING_DIR / f"{run_id}.json"


def save_pending(log: MlflowLogger, calls: list[tuple]) -> Path | None:
    """Save the calls a run could not deliver (its end last) where the next run of this repository
    finds them: it makes them and so ends the run with its own status, never KILLED for a slow server.
    JSON, not pickle: the next run reads the file as data (a queued call that is not plain data, such as
    an ad-hoc callable, is left out)."""
    encoded = [c for c in (_encode_call(call) for call in calls) if c is not None]
    if not encoded:
        return None
    path = write_bytes_atomic(pending_path(log.run_id), json.dumps({"uri": log.uri, "run_id": log.run_id,
                                                                    "calls": encoded}).encode())
    calls = encoded
    print(f"warning: MLflow at {log.uri}: {len(calls)} tracking calls of run {log.run_id} (its end among them) "
          f"saved to {path}; the next run here makes them", file=sys.stderr)
    return path


def load_pending(uri: str) -> list[tuple[Path, dict[str, Any]]]:
    """The saved calls for ``uri`` (each run's file and its record, one file per run). A file is taken by
    renaming it to ``<run>.<pid>.taking``, so two stages starting side by side never make the same
    calls twice; one whose taker died is taken again."""
    folder = repo_root() / PENDING_DIR
    files = [p for p in folder.iterdir() if p.suffix in (".json", ".taking")] if folder.is_dir() else []
    out = []
    for path in sorted(files):
        run_id, _, rest = path.name.partition(".")
        taker = rest.split(".")[0]
        if path.suffix == ".taking" and (not taker.isdigit() or pid_alive(int(taker))):
            continue  # another process is making these calls now
        taken = path.with_name(f"{run_id}.{os.getpid()}.taking")
        try:
            path.rename(taken)
            record = json.loads(taken.read_bytes())
            record["calls"] = [_decode_call(c) for c in record["calls"]]
        except OSError:  # taken by another process just now
            continue
        except (ValueError, TypeError, KeyError, AttributeError, ImportError) as exc:  # not a file we wrote
            print(f"warning: {taken}: not a saved MLflow call list ({type(exc).__name__}: {str(exc)[:120]}); "
                  "left in place", file=sys.stderr)
            taken.rename(taken.with_suffix(".invalid"))
            continue
        if record.get("uri") != uri:  # another server's: leave it for a run that logs there
            taken.rename(pending_path(run_id))
            continue
        out.append((taken, record))
    return out
