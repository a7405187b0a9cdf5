"""Where the tools meet (docs/orchestration.md): the workspace lock, the tracking URI and git state
rules, overrides applied as `dvc exp run -S` does, configs DVC can set, the cron check (fast); a
second concurrent stage and a killed one, with real stage processes (default suite)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUIET_ENV, REPO, copy_repo

ENV = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}


def cli(cwd: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, check=False, timeout=timeout)


# --------------------------------------------------------------------------- the lock (fast)

def test_lock_refuses_a_second_holder_and_clears_a_dead_ones(tmp_path):
    from pipeline.core.lock import LOCK_FILE, WorkspaceBusyError, read_holder, workspace_lock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pipeline.core.lock import workspace_lock\n"
                               "with workspace_lock('stage sft'):\n    print('held', flush=True); time.sleep(60)"],
                              cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkspaceBusyError, match=rf"stage sft \(pid {holder.pid} "):
            with workspace_lock("stage grpo", tmp_path):
                pass
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, naming a dead pid
        holder.wait()
    assert read_holder(tmp_path)["pid"] == holder.pid
    with workspace_lock("stage grpo", tmp_path) as mine:  # the killed run's file is no lock: taken
        assert read_holder(tmp_path)["token"] == mine["token"]
        with workspace_lock("stage grpo (torchrun rank)", tmp_path):  # our own child passes (token in env)
            pass
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_that_cannot_be_written_leaves_no_lock(tmp_path):
    """A full disk while the lock is taken (here `ulimit -f 0`): the run fails, and no lock, not even
    an empty one, is left behind to block the next run."""
    import resource

    from pipeline.core.lock import LOCK_FILE, workspace_lock

    res = subprocess.run([sys.executable, "-c", "from pipeline.core.lock import workspace_lock\n"
                          "with workspace_lock('stage sft'):\n    pass"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, check=False, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert res.returncode != 0 and "File too large" in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the lock nor its temporary file
    with workspace_lock("stage sft", tmp_path):
        assert (tmp_path / LOCK_FILE).read_text()


def test_second_concurrent_stage_exits_2_with_one_line_naming_the_first(tmp_path):
    """A real stage holds the lock; the same stage started again in the folder stops before any work."""
    repo = copy_repo(tmp_path / "repo", git=False)
    first = subprocess.Popen([sys.executable, "-m", "pipeline", "prepare", "--set", "data.arith_train_size=200000"],
                             cwd=repo, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (repo / ".pipeline.lock").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.2)
        second = cli(repo, "pipeline", "prepare")
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and "stage prepare" in lines[0], second.stderr
        assert not (repo / "data" / "stats.json").exists()  # the second one wrote nothing
    finally:
        first.kill()
        first.wait()


# --------------------------------------------------------------------------- tracking rules (fast)

def test_relative_sqlite_uri_resolves_at_the_repository_root(tmp_path, monkeypatch):
    from pipeline.tracking import resolve_uri

    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "user-repo"))  # what DVC sets, also under --temp
    assert resolve_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'user-repo' / 'mlflow.db'}"
    assert resolve_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert resolve_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.delenv("DVC_ROOT")
    monkeypatch.chdir(tmp_path)
    assert resolve_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"


def test_git_state_ignores_pipeline_outputs_and_params_but_not_code(tmp_path):
    from pipeline.tracking import git_state

    env = {**ENV, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "grpo.csv").write_text("iteration,reward\n0,0.5\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("grpo:\n  lr: 0.001\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "c"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "plots" / "grpo.csv").unlink()  # DVC removes a stage's outs before running it
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")  # untracked
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "params.yaml").write_text("grpo:\n  lr: 0.002\n")  # `dvc exp run -S`: logged as params
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (head, True)


def test_stage_metrics_are_namespaced_by_stage():
    from pipeline.tracking import StageNamespace

    seen = {}

    class Recorder:
        def log_metrics(self, metrics, step):
            seen.update(metrics)

    StageNamespace(Recorder(), "warmup").log_metrics({"train/reward": 0.5, "eval/x": 1.0}, step=0)
    assert seen == {"warmup/reward": 0.5, "eval/x": 1.0}


# --------------------------------------------------------------------------- params and configs (fast)

def test_overrides_keep_comments_and_name_a_missing_key(tmp_path):
    from flows.experiment import apply_overrides
    from pipeline.core.errors import InputError

    params = tmp_path / "params.yaml"
    params.write_text("# header\ngrpo:\n  # the KL weight\n  kl_coef: 0.04\n  lr: 1.0e-05  # step size\n")
    apply_overrides(params, ["grpo.kl_coef=0.02"])
    assert params.read_text() == "# header\ngrpo:\n  # the KL weight\n  kl_coef: 0.02\n  lr: 1.0e-05  # step size\n"
    with pytest.raises(InputError, match="params.yaml: cannot apply grpo.kl_coefs=1"):
        apply_overrides(params, ["grpo.kl_coefs=1"])


@pytest.mark.parametrize("path", sorted(REPO.glob("recipes/*/params.yaml")), ids=lambda p: p.parent.name)
def test_recipe_params_hold_every_key_so_dvc_exp_run_can_set_any(path):
    keys = lambda d: {(s, k) for s, sec in d.items() for k in sec}  # noqa: E731
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = keys(base) - keys(yaml.safe_load(path.read_text()))
    assert not missing, f"{path} lacks {sorted(missing)}: python -m pipeline.core.config_render {path} > it"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_configs_hold_only_the_keys_they_change(path, monkeypatch):
    """A file in configs/ is an override file: each key it holds differs from its default, so a reader
    sees what the config is about; `config_render FILE` writes it out in full for DVC, with the same
    values."""
    import pipeline.core.config_loading as loading
    from pipeline.core.config import Config
    from pipeline.core.config_render import render_params

    monkeypatch.setattr(loading, "_check_memory", lambda cfg, source: None)  # GPU configs on this machine
    defaults = Config().flat()
    raw = yaml.safe_load(path.read_text())
    cfg = loading.load_config(path)
    same = [f"{s}.{k}" for s, sec in raw.items() for k in sec if cfg.flat()[f"{s}.{k}"] == defaults[f"{s}.{k}"]]
    assert not same, f"{path.name} repeats defaults: {same}"
    assert loading.config_from_dict(yaml.safe_load(render_params(cfg))) == cfg


def test_configs_together_stay_short():
    assert sum(len(p.read_text().splitlines()) for p in (REPO / "configs").glob("*.yaml")) <= 600


def test_config_render_writes_a_config_out_in_full_and_refuses_a_missing_one(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "pipeline.core.config_render", "configs/smoke.yaml"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    full = yaml.safe_load(res.stdout)
    assert full["model"]["n_embd"] == 32 and full["grpo"]["kl_coef"] == 0.04  # the config's value; a default
    assert {(s, k) for s, sec in full.items() for k in sec} == {
        (s, k) for s, sec in yaml.safe_load((REPO / "params.yaml").read_text()).items() for k in sec}
    res = subprocess.run([sys.executable, "-m", "pipeline.core.config_render", "configs/nope.yaml"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: configs/nope.yaml: params file not found (pass --params FILE or run where params.yaml is)"]


def test_params_file_other_than_params_yaml_becomes_overrides(tmp_path, monkeypatch):
    from flows.grpo_pipeline import effective_overrides
    from pipeline.core.config_loading import load_config

    monkeypatch.chdir(REPO)
    over = effective_overrides(str(REPO / "configs" / "smoke.yaml"), ["grpo.kl_coef=0.02"])
    assert over[-1] == "grpo.kl_coef=0.02" and "sft.steps=6" in over
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    from flows.experiment import apply_overrides

    apply_overrides(params, over)  # what DVC applies reads back as the smoke config plus the override
    smoke = load_config(REPO / "configs" / "smoke.yaml", ["grpo.kl_coef=0.02"])
    assert load_config(params).flat() == smoke.flat()


@pytest.mark.slow
def test_bad_cron_is_one_line_exit_2():
    proc = cli(REPO, "flows.serve", "--cron", "every day", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--cron 'every day'" in proc.stderr and "0 3 * * *" in proc.stderr


# --------------------------------------------------------------------------- DVC decides (fast helpers)

def test_task_reads_the_commands_report_and_dvc_lock_not_log_text():
    """Whether a stage ran, was restored from DVC's run cache or skipped, and what its failure was, come
    from the command's JSON report and dvc.lock's record, never from DVC's or the CLI's English."""
    from pipeline.core.errors import InputError
    from pipeline.tracking import TrackingUnavailableError
    from tasks.stages import StageFailed, failure, stage_status

    rec = {"cmd": "python -m pipeline grpo", "outs": [{"path": "checkpoints/grpo", "md5": "a"}]}
    assert stage_status({"stage": "grpo", "ran": True}, rec, {**rec, "outs": []}) == "ran"
    assert stage_status(None, rec, rec) == "skipped"
    assert stage_status(None, None, rec) == "restored"  # outputs checked out of the run cache
    assert stage_status(None, rec, {**rec, "outs": [{"path": "checkpoints/grpo", "md5": "b"}]}) == "restored"
    lines = ["Running stage 'prepare':", "some output", "ERROR: failed to reproduce 'prepare'"]
    bad = failure("prepare", {"error": "data.gsm8k_source: /x: not found", "kind": "input"}, lines, 2)
    assert type(bad) is InputError and str(bad) == "prepare: data.gsm8k_source: /x: not found"
    down = failure("sft", {"error": "MLflow tracking at http://h is unavailable", "kind": "tracking"}, [], 2)
    assert isinstance(down, TrackingUnavailableError)
    assert type(failure("sft", {"error": "9 non-finite steps in a row", "kind": "diverged"}, [], 2)) is StageFailed
    # an `error:` line without a report is not read as the stage's error: DVC's failure, with the tail
    assert type(failure("grpo", None, ["error: looks like a user error", "Traceback"], 255)) is StageFailed


def test_the_cli_reports_what_it_did_as_json(tmp_path):
    """`python -m pipeline` writes its report where $GRPO_STAGE_REPORT says: the error and its kind for a
    user's mistake (with the usual one line on stderr)."""
    import json

    report = tmp_path / "r.json"
    env = {**ENV, "GRPO_STAGE_REPORT": str(report)}
    res = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--set", "data.val_size=-1"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    got = json.loads(report.read_text())
    assert got["kind"] == "input" and res.stderr.strip() == f"error: {got['error']}"


# --------------------------------------------------------------------------- no run left RUNNING

@pytest.mark.slow
def test_killed_stage_run_is_marked_killed_on_the_next_start(tmp_path):
    from mlflow.tracking import MlflowClient

    repo = copy_repo(tmp_path / "repo")
    uri = f"sqlite:///{repo / 'mlflow.db'}"
    track = ["--set", "tracking.enabled=true", "--set", "tracking.experiment=kill"]
    assert cli(repo, "pipeline", "prepare", *track).returncode == 0
    sft = subprocess.Popen([sys.executable, "-m", "pipeline", "sft", *track, "--set", "sft.steps=100000"],
                           cwd=repo, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = MlflowClient(tracking_uri=uri)
    try:
        deadline = time.monotonic() + 180
        while True:
            exp = client.get_experiment_by_name("kill")
            running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
            if running:
                break
            assert sft.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        os.kill(sft.pid, signal.SIGKILL)
        sft.wait()
    [killed] = running
    assert client.get_run(killed.info.run_id).info.status == "RUNNING"  # nobody could close it
    assert cli(repo, "pipeline", "prepare", *track).returncode == 0  # the next start
    assert client.get_run(killed.info.run_id).info.status == "KILLED"
    exp = client.get_experiment_by_name("kill")
    assert client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") == []
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    runs = client.search_runs([exp.experiment_id])
    assert {r.data.tags["mlflow.source.git.commit"] for r in runs} == {head}
    assert {r.data.tags["grpo.dirty"] for r in runs} == {"false"}
    assert json.loads((repo / "data" / "stats.json").read_text())


# --------------------------------------------------------------------------- make run leaves tracked files alone

VENV = Path(sys.prefix)


@pytest.mark.slow
@pytest.mark.skipif(not (VENV / ".installed").is_file(), reason="needs the project's venv built by `make setup`")
def test_make_run_with_a_local_gsm8k_changes_no_tracked_file(tmp_path):
    """`make run GSM8K=PATH` on a fresh clone: an experiment, one MLflow parent, the headline table,
    and `git status --porcelain` lists no tracked file changed (so `make test` passes after it)."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import GSM8K, experiment, sh, tracked_repo

    origin = tracked_repo(tmp_path / "origin", "make")
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(clone))
    params = (clone / "params.yaml").read_bytes()
    # -o: use the test's venv as it is (a fresh clone's files are newer than its .installed stamp, and
    # re-installing would point the shared venv's editable install at this temporary clone)
    proc = subprocess.run(["make", "-o", f"{VENV}/.installed", "run", f"GSM8K={GSM8K}", f"VENV={VENV}"], cwd=clone, env=ENV,
                          capture_output=True, text=True, check=False, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    changed = [line for line in sh(clone, "git", "status", "--porcelain").splitlines() if not line.startswith("??")]
    assert changed == [] and (clone / "params.yaml").read_bytes() == params
    name = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("experiment "))
    assert experiment(clone, name)["params"]["params.yaml"]["data"]["data"]["gsm8k_source"] == str(GSM8K)
    assert "stage" in proc.stdout and "gsm8k acc" in proc.stdout  # the headline table
    client = MlflowClient(tracking_uri=f"sqlite:///{clone / 'mlflow.db'}")
    exp = client.get_experiment_by_name("make")
    parents = client.search_runs([exp.experiment_id], "tags.`grpo.role` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"


@pytest.mark.slow
def test_flow_cli_in_a_busy_workspace_is_one_line_exit_2(tmp_path):
    from pipeline.core.lock import workspace_lock

    repo = copy_repo(tmp_path / "repo", git=False)
    holder = subprocess.Popen([sys.executable, "-c", "import time\nfrom pipeline.core.lock import workspace_lock\n"
                               "with workspace_lock('flow run nightly'):\n    print('held', flush=True); time.sleep(60)"],
                              cwd=repo, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = cli(repo, "flows.grpo_pipeline")
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "flow run nightly" in proc.stderr, proc.stderr
    finally:
        holder.kill()
        holder.wait()
    with workspace_lock("next", repo):  # the dead holder's lock is cleared
        pass
