"""The stage logger: one logging thread per MLflow run and its failure policy (see
:mod:`pipeline.tracking.mlflow_backend`).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.tracking.common import TrackingUnavailableError, temporary_env
from pipeline.tracking.mlflow_client import FLUSH_TIMEOUT_S, _log_params, _unreachable, probe


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
        self._down_lock = threading.Lock()
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
                self._mark_down(f"{type(exc).__name__}: {msg}")
                return
            self._broken.add(what)
            print(f"warning: MLflow {what} failed on {self.uri} ({type(exc).__name__}: {msg}); "
                  f"{what} disabled for the rest of this stage", file=sys.stderr)

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

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait up to `timeout` s for the queued calls; False (one warning, the rest dropped) if not done."""
        done = threading.Event()
        self._queue.put(("__flush__", done.set, (), {}))
        start = time.monotonic()
        deadline, probed = start + timeout, False
        while not done.wait(0.05):
            if self._down or time.monotonic() > deadline:  # a dead server: nothing left worth waiting for
                break
            # a call still pending after half a second may be sitting in the HTTP client's retries
            # against a server that is gone: ask its health check once rather than wait them out
            if not probed and time.monotonic() - start > 0.5:
                probed = True
                if not self._answers():
                    self._mark_down("no answer to its health check at the end of the stage")
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
