"""Tracking never holds training back: calls are queued for one logging thread, a dead server is
one warning, the final flush gives up in seconds; a URI that cannot work is refused at once."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from pipeline.core.config import Config, TrackingConfig
from pipeline.tracking import TrackingUnavailableError, stage_logger
from pipeline.tracking.mlflow_client import check_uri
from pipeline.tracking.mlflow_logger import MlflowLogger
from tests.conftest import QUIET_ENV, REPO


def make_cfg(uri: str) -> Config:
    return Config(tracking=TrackingConfig(enabled=True, uri=uri, experiment="faults"))


@pytest.fixture
def blocker(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path


@pytest.mark.parametrize("uri,pattern", [
    ("foo://x", r"unsupported scheme 'foo'"),
    ("file://", r"a file store"),
    ("file:///srv/mlruns", r"a file store"),
    ("./mlruns", r"a file store"),
    ("http://", r"no host"),
    ("sqlite:///{tmp}/afile/mlflow.db", r"afile is a file, so .*mlflow.db cannot be created under it"),
    ("sqlite:///{tmp}", r"is a folder, not a database file"),
    ("sqlite:////proc/mlflow.db", r"/proc/mlflow.db cannot be written"),
])
def test_uris_that_cannot_work_are_refused_in_one_line(blocker, uri, pattern):
    uri = uri.format(tmp=blocker)
    with pytest.raises(TrackingUnavailableError, match=pattern) as info:
        with stage_logger(make_cfg(uri), "sft"):
            pass
    assert "\n" not in str(info.value) and "tracking.enabled=false" in str(info.value)


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/new/sub/mlflow.db", "sqlite:///:memory:", "http://127.0.0.1:5000",
                                 "https://mlflow.example.com/", "postgresql://u@h/db", "databricks"])
def test_uris_that_can_work_pass(blocker, uri):
    assert check_uri(uri.format(tmp=blocker)) == uri.format(tmp=blocker)


def test_cli_refuses_a_bad_uri_fast_with_exit_2(blocker):
    res = subprocess.run([sys.executable, "-m", "pipeline", "compare", "--params", str(REPO / "configs" / "smoke.yaml"),
                          "--set", "tracking.enabled=true", "--set", f"tracking.uri=sqlite:///{blocker}/afile/x.db"],
                         cwd=blocker, capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, **QUIET_ENV, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "cannot be created under it" in res.stderr


class FakeClient:
    """Stands in for the server's side of MlflowClient: records calls, can block or refuse."""

    def __init__(self):
        self.calls, self.gate, self.error = [], threading.Event(), None
        self.gate.set()

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.gate.wait()
        if self.error:
            raise self.error
        self.calls.append([m.key for m in metrics])


@pytest.mark.timeout(60)
def test_logging_never_waits_on_the_server(capsys):
    client = FakeClient()
    client.gate.clear()  # the server hangs
    log = MlflowLogger(client, "run0", "http://127.0.0.1:1")
    done = threading.Event()
    threading.Thread(target=lambda: (log.log_metrics({"a": 1.0}, 1), log.log_metrics({"b": 2.0}, 2), done.set()),
                     daemon=True).start()
    assert done.wait(30), "log_metrics blocked on the server"
    client.gate.set()
    log.close()
    assert client.calls == [["a"], ["b"]] and log.last == {"a": 1.0, "b": 2.0}
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(60)
def test_a_dead_server_is_one_warning_and_the_flush_does_not_wait(capsys):
    client = FakeClient()
    client.error = ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch (Connection refused)")
    log = MlflowLogger(client, "run0", "http://127.0.0.1:1")
    for step in range(20):
        log.log_metrics({"reward": 0.1 * step}, step)
        log.set_tags({"k": "v"})
        log.log_params({"p": 1})
    log.flush(timeout=3600)  # returns as soon as the server is known dead, not in an hour (the hang guard)
    assert log._down and len(client.calls) == 0
    log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "stopped answering" in warnings[0] and "training goes on" in warnings[0]


@pytest.mark.timeout(60)
def test_a_hung_server_makes_the_flush_give_up_with_one_warning(capsys):
    client = FakeClient()
    client.gate.clear()  # never answers
    log = MlflowLogger(client, "run0", "http://127.0.0.1:1")
    log.log_metrics({"a": 1.0}, 1)
    log.close(timeout=0.5)
    err = capsys.readouterr().err
    assert err.count("warning: MLflow") == 1 and "gave up after 0.5 s" in err
    log.log_metrics({"b": 1.0}, 2)  # after giving up, calls are dropped, not queued behind the hang
    assert log._queue.qsize() <= 2
    client.gate.set()


def test_a_failing_kind_stops_only_that_kind(capsys):
    client = FakeClient()
    log = MlflowLogger(client, "run0", "sqlite:///unused.db")  # a server that answers: the call itself was bad

    def bad_table(*a, **k):
        raise ValueError("table too big")

    log._guard("log_table", bad_table)
    log._guard("log_table", bad_table)
    log.log_metrics({"a": 1.0}, 1)
    log.close()
    err = capsys.readouterr().err
    assert err.count("warning: MLflow log_table failed") == 1 and client.calls == [["a"]]


@pytest.mark.timeout(120)
def test_closing_the_pipeline_run_on_a_dead_server_is_one_warning(capsys):
    from pipeline.tracking import end_pipeline_run

    end_pipeline_run(make_cfg("http://127.0.0.1:1"), "0123456789abcdef", "FINISHED")  # nothing listens on port 1
    err = capsys.readouterr().err
    assert err.count("warning: MLflow") == 1 and "could not close the pipeline run 0123456789abcdef" in err
