"""What a new user meets on the first day: the time a stage has left, a mistyped path or a wrong
model folder as one line that says what to do, and the same through the flow's command line.

The flow experiments on a copy of the whole repository (recipes included) are in test_flows.py,
test_orchestration.py and test_integration_servers.py; `make demo` in test_demo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import InputError
from pipeline.core.progress import Pace, duration
from tests.conftest import QUIET_ENV, REPO, copy_repo

# --------------------------------------------------------------------------- the time left


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (0.4, "0s"), (59.4, "59s"), (60, "1m00s"), (545, "9m05s"),
                                          (3599, "59m59s"), (3600, "1h00m"), (3725, "1h02m"), (-3, "0s")])
def test_a_duration_reads_as_a_log_line_writes_it(seconds, text):
    assert duration(seconds) == text


def test_pace_is_the_mean_time_per_step_of_this_process_and_the_time_left_at_that_pace():
    clock = Clock()
    pace = Pace(0, 185, clock=clock)
    assert pace.text(0) == ""  # no step yet: nothing to say
    clock.now += 2.5
    assert pace.text(1) == "2.5 s/it, eta 7m40s"  # 184 left x 2.5 s = 460 s
    clock.now += 7.5  # three more steps: 10 s for 4
    assert pace.text(4) == "2.5 s/it, eta 7m32s"  # 181 x 2.5 = 452.5, rounded to even
    clock.now += 452.5
    assert pace.text(185) == "2.5 s/it, eta 0s"


def test_a_resumed_stage_counts_its_pace_from_the_resume_not_from_step_zero():
    clock = Clock()
    pace = Pace(40, 50, unit="step", clock=clock)  # resumed at step 40 after a crash
    clock.now += 3.0
    assert pace.text(41) == "3 s/step, eta 27s"  # one step ran here, in 3 s; 9 left


# --------------------------------------------------------------------------- a mistyped path


def test_a_mistyped_local_path_is_a_missing_folder_with_the_close_name_not_a_hub_id(tmp_path, monkeypatch):
    from pipeline.data import gsm8k as gs

    (tmp_path / "datasets" / "gsm8k").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    typo = r"'datasets/gsmk8': no such file or folder .*did you mean 'datasets/gsm8k'\?$"
    with pytest.raises(InputError, match=typo):
        gs.load_raw("datasets/gsmk8")
    with pytest.raises(InputError, match=r"'datasets/other': no such file or folder \(relative paths .*\)$"):
        gs.load_raw("datasets/other")  # nothing close: no guess


def test_an_hf_model_folder_with_the_gpt_backend_names_the_fix_before_a_tokenizer_is_trained(tmp_path, hf_dirs):
    from pipeline.core.config_loading import load_config
    from pipeline.stages.prepare import _tokenizer
    from pipeline.train.checkpoint import init_policy

    cfg = load_config(REPO / "configs" / "smoke.yaml", [f"model.init={hf_dirs['gpt2']}"])
    with pytest.raises(InputError, match=r"is a Hugging Face model folder .*set model.backend=hf"):
        _tokenizer(cfg, [{"prompt": "1 + 1", "solution": "2"}])
    with pytest.raises(InputError, match=r"not a checkpoint folder .*set model.backend=hf to start from it$"):
        init_policy(cfg.model)


# --------------------------------------------------------------------------- the flow's command line


def flow_cli(repo: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", "flows.grpo_pipeline", *args], cwd=repo, env=env,
                          capture_output=True, text=True, check=False, timeout=timeout)


@pytest.mark.slow
def test_a_mistyped_gsm8k_path_through_the_flow_is_one_line_before_prefect_starts(tmp_path):
    """What `make run GSM8K=datasets/gsmk8` or `--set data.gsm8k_source=...` meets: one line naming the
    key, the close name and what DVC needs, exit 2, and no Prefect server started for it."""
    repo = copy_repo(tmp_path / "repo", git=False)
    proc = flow_cli(repo, "--set", "data.gsm8k_source=datasets/gsmk8", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: data.gsm8k_source = 'datasets/gsmk8'")
    assert "did you mean 'datasets/gsm8k'?" in proc.stderr
    assert "Starting temporary server" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_stages_bad_input_through_the_flow_ends_in_one_line_and_no_traceback(tmp_path):
    """A source DVC can hash but prepare refuses (a folder without GSM8K's files): the task and the run
    end Failed with the stage's line, the command's last line is that error, and no traceback is
    printed anywhere (Prefect used to log the flow's and the task's exceptions in full)."""
    repo = copy_repo(tmp_path / "repo")
    (tmp_path / "empty").mkdir()
    proc = flow_cli(repo, "--set", f"data.gsm8k_source={tmp_path / 'empty'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # the command's own line (Prefect may still log its server's stop after it)
    [error] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert error.startswith("error: prepare: ") and "expected train and test files" in error, proc.stderr[-2000:]
    assert not (repo / "data").exists()  # the run was an experiment's copy; the workspace is as it was
    listed = json.loads(subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=repo,
                                       capture_output=True, text=True, check=True).stdout)
    assert not [e for row in listed for e in row.get("experiments") or []]


@pytest.mark.slow
def test_a_finished_run_ends_with_where_to_look(tmp_path, monkeypatch):
    """The commands that open the run in MLflow's and Prefect's UIs, on 127.0.0.1, with the database the
    run logged to (the repository's, also for an experiment run in a copy), and DVC's view of it."""
    from flows.grpo_pipeline import where_to_look
    from pipeline.core.config_loading import load_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    cfg = load_config(REPO / "configs" / "smoke.yaml", ["tracking.enabled=true", "tracking.experiment=mine"])
    text = where_to_look(cfg, "nightly-7")
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db --host 127.0.0.1 --port 5000" in text
    assert "experiment 'mine'" in text and "prefect server start --host 127.0.0.1" in text
    assert "dvc exp show --drop 'recipes/'  # experiment nightly-7" in text
    off = where_to_look(load_config(REPO / "configs" / "smoke.yaml"))
    assert "tracking is off (tracking.enabled: false)" in off and "mlflow ui" not in off
