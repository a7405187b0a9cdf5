"""Real servers on 127.0.0.1 (free ports, temporary homes), always stopped by their fixtures:

- a Prefect server + `python -m flows.serve` (cron deployment), a run triggered with run_deployment;
- a process work pool (`python -m flows.deploy`) and a real `prefect worker start`: two sweeps side by
  side, each pushed to a git remote and a DVC remote, both logged to one MLflow server;
- an MLflow server the smoke pipeline logs to; metric histories read back with MlflowClient, and
  fail-fast when the server is gone;
- a flow stopped as a terminal's Ctrl-C (SIGINT to its process group) or systemd/Docker/Kubernetes
  (SIGTERM to its process alone) stops, with a real and with the temporary Prefect API, and a
  stopped experiment resumes;
- an MLflow server behind a lagging proxy: a stage's run still ends FINISHED with every point.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.core.config import STAGES
from tests.conftest import QUIET_ENV, copy_repo, sh, task_runs_of

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """A child in its own process group (so stop() ends it and whatever it spawned)."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


def base_env(repo: Path) -> dict[str, str]:
    return {**os.environ, **QUIET_ENV, "PYTHONPATH": str(repo),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


# --------------------------------------------------------------------------- Prefect

@pytest.fixture
def prefect_server(tmp_path):
    port = free_port()
    home = tmp_path / "prefect_home"
    home.mkdir()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": url,
           "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_KEY", None)
    log = tmp_path / "prefect_server.log"
    proc = start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 tmp_path, env, log)
    try:
        wait_http(f"{url}/health", proc, log)
        yield {"url": url, "env": env}
    finally:
        stop(proc)


@pytest.mark.slow
def test_served_deployment_runs_on_trigger(tmp_path, prefect_server):
    """A triggered run with an override is a DVC experiment: the workspace's params and outputs stay
    as they were, `dvc status` is clean, `dvc exp show` lists it; the deployment holds limit 1."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.conftest import experiment, sh

    repo = copy_repo(tmp_path / "repo")
    sh(repo, "dvc", "repro")
    before = {p: (repo / p).read_bytes() for p in ("params.yaml", "dvc.lock", "metrics/eval.json",
                                                   "checkpoints/grpo/model.safetensors")}
    env = {**base_env(repo), **prefect_server["env"]}
    log = tmp_path / "serve.log"
    serve = start([sys.executable, "-m", "flows.serve", "--name", "itest", "--cron", "0 3 * * *",
                   "--params", "params.yaml"], repo, env, log)
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
            from prefect.client.orchestration import get_client

            deployment = None
            deadline = time.monotonic() + 60
            with get_client(sync_client=True) as client:
                while deployment is None:
                    assert serve.poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, log.read_text()[-3000:]
                    try:
                        deployment = client.read_deployment_by_name("grpo-pipeline/itest")
                    except Exception:  # not registered yet
                        time.sleep(0.5)
            crons = [getattr(s.schedule, "cron", None) for s in deployment.schedules]
            assert crons == ["0 3 * * *"] and deployment.parameters["params_path"] == "params.yaml"
            assert deployment.global_concurrency_limit.limit == 1  # held by the server, not the process
            flow_run = run_deployment("grpo-pipeline/itest", parameters={"overrides": ["grpo.kl_coef=0.02"]},
                                      timeout=600, poll_interval=2)
            assert flow_run.state.is_completed(), (flow_run.state, log.read_text()[-4000:])
            runs = task_runs_of(flow_run.id, expect=STAGES)
            for stage in STAGES:
                mine = [r for r in runs if r.name.rsplit("-", 1)[0] == stage]
                assert len(mine) == 1 and mine[0].state.is_completed(), (stage, runs)
        assert {p: (repo / p).read_bytes() for p in before} == before  # the workspace as it was found
        assert "up to date" in sh(repo, "dvc", "status", "dvc.yaml")
        data = experiment(repo, flow_run.name)
        assert data["params"]["params.yaml"]["data"]["grpo"]["kl_coef"] == 0.02
        assert "grpo" in data["metrics"]["metrics/train.json"]["data"]
    finally:
        stop(serve)


@pytest.mark.slow
def test_a_work_pool_runs_two_sweeps_side_by_side_and_shares_them(tmp_path, prefect_server, mlflow_server):
    """`python -m flows.deploy` on a process pool, a real `prefect worker start`: two override runs go
    side by side, each in its own clone of the git remote, and each shares what it made: its DVC
    experiment pushed to the remote (ref) and the shared DVC remote (outputs), its MLflow runs on the
    one tracking server. A fresh clone pulls either experiment back."""
    from mlflow.tracking import MlflowClient
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.experiment import exp_name
    from tests.conftest import GIT_ENV

    repo = copy_repo(tmp_path / "repo")
    storage = tmp_path / "dvc-remote"
    sh(repo, "dvc", "remote", "add", "-d", "shared", str(storage))
    sh(repo, "git", "commit", "-qam", "the shared DVC remote")
    origin = tmp_path / "origin.git"
    sh(tmp_path, "git", "clone", "-q", "--bare", str(repo), str(origin))
    env = {**base_env(repo), **prefect_server["env"], **GIT_ENV, "MLFLOW_TRACKING_URI": mlflow_server}
    deployed = subprocess.run([sys.executable, "-m", "flows.deploy", "--pool", "itest-pool", "--source", str(origin),
                               "--branch", "main", "--name", "sweep"], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=120)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    log = tmp_path / "worker.log"
    worker = start([str(BIN / "prefect"), "worker", "start", "--pool", "itest-pool", "--type", "process",
                    "--limit", "2"], tmp_path, env, log)
    track = ["tracking.enabled=true", f"tracking.uri={mlflow_server}", "tracking.experiment=pool"]
    sweeps = {"kl02": "grpo.kl_coef=0.02", "kl05": "grpo.kl_coef=0.05"}
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
            from prefect.client.orchestration import get_client

            triggered = {k: run_deployment("grpo-pipeline/sweep", parameters={"overrides": [o, *track]}, timeout=0)
                         for k, o in sweeps.items()}
            with get_client(sync_client=True) as client:
                runs = {k: wait_run(client, r.id, lambda run: run.state.is_final(), k, 900, log)
                        for k, r in triggered.items()}
        for k, run in runs.items():
            assert run.state.is_completed(), (k, run.state, log.read_text()[-4000:])
        first, second = sorted(runs.values(), key=lambda r: r.start_time)
        assert second.start_time < first.end_time, "the two runs did not overlap"  # side by side
    finally:
        stop(worker)
    exps = sh(origin, "git", "for-each-ref", "--format=%(refname)", "refs/exps")
    names = {k: exp_name(run.name) for k, run in runs.items()}
    for k, name in names.items():
        assert name in exps, (k, exps)
    assert any(storage.rglob("*")), "nothing reached the shared DVC remote"
    fresh = tmp_path / "fresh"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(fresh))
    for k, name in names.items():  # any machine gets a run's params, metrics and checkpoints back
        sh(fresh, "dvc", "exp", "pull", "origin", name)
        # as the flow prints it: `dvc exp apply` would check out the recipe's outputs too, which no run made
        sh(fresh, "dvc", "exp", "branch", name, f"exp-{name}")
        sh(fresh, "git", "checkout", "-q", f"exp-{name}")
        sh(fresh, "dvc", "pull", "dvc.yaml")
        assert yaml_value(fresh / "params.yaml", "grpo", "kl_coef") == float(sweeps[k].split("=")[1])
        assert "grpo" in json.loads((fresh / "metrics" / "train.json").read_text())
        sh(fresh, "dvc", "checkout", "checkpoints/grpo")
        assert (fresh / "checkpoints" / "grpo" / "model.safetensors").stat().st_size > 0
        sh(fresh, "git", "checkout", "-q", "main")
    client = MlflowClient(mlflow_server)
    [exp] = [e for e in client.search_experiments() if e.name == "pool"]
    parents = client.search_runs([exp.experiment_id], "tags.`grpo.experiment` != ''")
    tagged = {r.data.tags.get("grpo.experiment") for r in parents if "mlflow.parentRunId" not in r.data.tags}
    assert set(names.values()) <= tagged, tagged


def yaml_value(path: Path, section: str, key: str):
    import yaml

    return yaml.safe_load(path.read_text())[section][key]


# --------------------------------------------------------------------------- MLflow

@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    home = tmp_path / "mlflow_home"
    home.mkdir()
    log = tmp_path / "mlflow_server.log"
    proc = start([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                  "--backend-store-uri", f"sqlite:///{home / 'tmp.db'}",
                  "--artifacts-destination", str(home / "artifacts")],
                 home, {**os.environ, **QUIET_ENV}, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def test_smoke_pipeline_logs_to_mlflow_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    repo = copy_repo(tmp_path / "repo", git=False)
    env = base_env(repo)
    env.pop("MLFLOW_TRACKING_URI", None)
    track = ["--set", "tracking.enabled=true", "--set", f"tracking.uri={mlflow_server}",
             "--set", "tracking.experiment=itest"]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "all", *track], cwd=repo, env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"smoke pipeline against the MLflow server: {time.monotonic() - t0:.0f} s")

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("itest")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("grpo.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    stages = {r.data.tags["grpo.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert {"prepare", "sft", "warmup", "control", "grpo", "evaluate"} <= set(stages)
    grpo = stages["grpo"]
    history = client.get_metric_history(grpo.info.run_id, "grpo/reward")
    steps = [m.step for m in history]  # one point per iteration, stepped by iteration
    assert len(steps) == 2 and steps == sorted(set(steps))
    assert grpo.data.params["grpo.kl_coef"] and grpo.data.tags["grpo.stage"] == "grpo"
    assert any(k.startswith("eval/") for k in stages["evaluate"].data.metrics)
    assert client.list_artifacts(stages["evaluate"].info.run_id)

    # compare: the CLI table reads the same server
    cmp = subprocess.run([sys.executable, "-m", "pipeline", "compare", *track], cwd=repo, env=env,
                         capture_output=True, text=True, check=False, timeout=120)
    assert cmp.returncode == 0 and "grpo/reward" in cmp.stdout, cmp.stderr[-2000:]

    # the server gone: a training stage fails before training (no iteration logged, no resume
    # state written) and keeps its outputs
    outputs = ("checkpoints/grpo/model.safetensors", "plots/grpo.csv")
    before = {p: (repo / p).read_bytes() for p in outputs}
    down = f"http://127.0.0.1:{free_port()}"
    fail = subprocess.run([sys.executable, "-m", "pipeline", "grpo", "--set", "tracking.enabled=true",
                           "--set", f"tracking.uri={down}", "--set", "grpo.kl_coef=0.03"],
                          cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert fail.returncode == 2, fail.stderr[-2000:]
    assert down in fail.stderr and "tracking.enabled=false" in fail.stderr
    assert {p: (repo / p).read_bytes() for p in outputs} == before
    assert not (repo / "checkpoints" / "grpo.resume").exists()
    print(json.dumps({"runs": len(runs)}))


# --------------------------------------------------------------------------- stopping a flow

STOPPABLE_STAGE = """import json, os, shutil, signal, subprocess, sys, time
name = sys.argv[1]
os.makedirs("out", exist_ok=True)
if name == "grpo":  # a long stage with a child of its own that resumes from a state saved every step
    child = subprocess.Popen(["sleep", "600"])
    for what, pid in (("pid", os.getpid()), ("child", child.pid)):
        with open(f"out/grpo.{what}", "w") as f:
            f.write(str(pid))
    def stop(sig, frame):
        with open("out/grpo.signal", "w") as f:
            f.write(signal.Signals(sig).name)
        sys.exit(128 + sig)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    os.makedirs("checkpoints/grpo.resume", exist_ok=True)
    step = len(os.listdir("checkpoints/grpo.resume"))
    if step:
        print(f"grpo resumed from step {step}", flush=True)
    while step < int(os.environ.get("GRPO_STEPS", "1000000")):
        step += 1
        os.makedirs(f"checkpoints/grpo.resume/step_{step:06d}")
        print(f"grpo {step}", flush=True)
        time.sleep(0.2)
    shutil.rmtree("checkpoints/grpo.resume")
    child.kill()
with open(f"out/{name}.json", "w") as f:
    json.dump({"end": time.time()}, f)
"""


def stoppable_repo(root: Path) -> Path:
    """A git + DVC copy of the repo (smoke params, tracking on) whose dvc.yaml has the pipeline's stages
    and graph, each a tiny script; grpo runs until stopped (or GRPO_STEPS steps), saving a resume state
    each step, and records the signal it got."""
    import yaml

    from flows.experiment import apply_overrides
    from flows.grpo_pipeline import stage_graph
    from tests.conftest import REPO

    repo = copy_repo(root)
    (repo / "stage.py").write_text(STOPPABLE_STAGE)
    stages = {name: {"cmd": f"python stage.py {name}", "deps": ["stage.py", *(f"out/{u}.json" for u in ups)],
                     "outs": [{f"out/{name}.json": {"cache": False}}]} for name, ups in stage_graph(REPO).items()}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    apply_overrides(repo / "params.yaml", ["tracking.enabled=true", "tracking.experiment=stops"])
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "stoppable stages")
    return repo


def kill_leftovers(out: Path) -> None:
    """SIGKILL what a tiny grpo stage started and a failed test left running (its own pids only)."""
    for what in ("pid", "child"):
        f = out / f"grpo.{what}"
        if f.is_file():
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def as_a_terminal_job() -> None:
    """In the child before exec: SIGINT back to its default, as a terminal's foreground job has it. A suite
    started in the background (`cmd &`, nohup) hands its children an ignored SIGINT, which Python then
    keeps ignoring, and no Ctrl-C could reach the flow."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_flow_in_grpo(repo: Path, env: dict, sig: int, args: tuple = (), where=None) -> tuple[int, float, str, Path]:
    """Start `python -m flows.grpo_pipeline` in its own process group (a terminal's job), wait until grpo
    has saved 3 more steps in the folder the stages run in (`where()`: default the repo), then send `sig`:
    SIGINT to the group (Ctrl-C), SIGTERM to the flow's process alone. Returns (exit status, seconds
    from the signal to the exit, output, that folder)."""
    where = where or (lambda: repo)
    log = repo.parent / f"flow-{time.monotonic_ns()}.log"
    (repo / "out" / "grpo.signal").unlink(missing_ok=True)
    kept = repo / "checkpoints" / "grpo.resume"  # a state kept by a stopped run: wait for 3 steps more
    step = f"step_{len(list(kept.iterdir())) + 3 if kept.is_dir() else 3:06d}"
    proc = subprocess.Popen([sys.executable, "-m", "flows.grpo_pipeline", *args], cwd=repo, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=as_a_terminal_job)
    work = None
    try:
        deadline = time.monotonic() + 300
        while not (work := where()) or not (work / "checkpoints" / "grpo.resume" / step).exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the flow had not exited 60 s after {signal.Signals(sig).name}: {log.read_text()[-3000:]}")
        return code, time.monotonic() - t0, log.read_text(), work
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if work is not None:
            kill_leftovers(work / "out")


def assert_stopped(work: Path, sig: int, code: int, seconds: float, output: str) -> None:
    """The stop as a user should see it: prompt, exit 128 + signal, one last line saying what to run, no
    traceback; the stage got the signal (its own child too), nothing started after it, its resume kept."""
    name = signal.Signals(sig).name
    last = output.strip().splitlines()[-2:]  # then Prefect's "Stopping temporary server" line, if any
    assert code == 128 + sig, output[-3000:]
    assert seconds < 30, (seconds, output[-3000:])
    # grpo is among the stages stopped (the control stage may still be running beside it)
    assert any(line.startswith(f"interrupted by {name}: stopped ") and "again to resume" in line
               and "grpo" in line.split(":", 1)[1].split("(")[0].replace(",", " ").split()
               for line in last), last
    assert "Traceback" not in output and "StageFailed" not in output
    assert (work / "out" / "grpo.signal").read_text() == name
    with pytest.raises(ProcessLookupError):
        os.kill(int((work / "out" / "grpo.child").read_text()), 0)
    assert not (work / "out" / "evaluate.json").exists()
    assert (work / "checkpoints" / "grpo.resume" / "step_000003").is_dir()


def parent_statuses(repo: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("stops")
    runs = client.search_runs([exp.experiment_id], "tags.`grpo.role` = 'pipeline'", order_by=["attributes.start_time ASC"])
    return [r.info.status for r in runs]


def flow_env(repo: Path, **extra: str) -> dict[str, str]:
    env = {**base_env(repo), "PREFECT_HOME": str(repo.parent / "prefect_home"), **extra}
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "GRPO_LOCK_TOKEN"):
        env.pop(k, None)
    return {**env, **extra}


@pytest.mark.slow
def test_sigterm_and_ctrl_c_stop_the_flow_and_its_stages_then_it_resumes(tmp_path, prefect_server):
    """SIGTERM to the flow's process, then Ctrl-C to its process group, each while grpo runs: the flow
    forwards the signal to the stage (and the stage's own child), starts nothing after it, keeps its
    resume state, ends its MLflow parent KILLED and its Prefect run Cancelled, and exits 128 + signal
    in seconds with one line; the re-run resumes grpo from the kept state."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    repo = stoppable_repo(tmp_path / "repo")
    env = flow_env(repo, PREFECT_API_URL=prefect_server["url"])
    outputs = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        code, seconds, output, _ = stop_flow_in_grpo(repo, env, sig)
        print(f"{signal.Signals(sig).name}: the flow exited {seconds:.1f} s after the signal")
        assert_stopped(repo, sig, code, seconds, output)
        outputs.append(output)
    assert "grpo resumed from step" not in outputs[0] and "grpo resumed from step" in outputs[1]
    assert parent_statuses(repo) == ["KILLED", "KILLED"]
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        with get_client(sync_client=True) as client:
            states = [r.state for r in client.read_flow_runs()]
    assert [s.type.value for s in states] == ["CANCELLED", "CANCELLED"], states
    assert {s.message.split(":")[0] for s in states} == {"interrupted by SIGTERM", "interrupted by SIGINT"}


@pytest.mark.slow
def test_ctrl_c_with_the_temporary_api_returns_in_seconds_and_cancels_the_run(tmp_path):
    """No PREFECT_API_URL: Prefect's temporary API is out of the Ctrl-C's reach, so the flow reports its
    run Cancelled to it and returns in seconds (it used to die with the Ctrl-C: 226 s, run left RUNNING)."""
    repo = stoppable_repo(tmp_path / "repo")
    code, seconds, output, _ = stop_flow_in_grpo(repo, flow_env(repo), signal.SIGINT)
    print(f"Ctrl-C with the temporary API: the flow exited {seconds:.1f} s after it")
    assert_stopped(repo, signal.SIGINT, code, seconds, output)
    assert parent_statuses(repo) == ["KILLED"]
    with sqlite3.connect(tmp_path / "prefect_home" / "prefect.db") as db:
        assert db.execute("select state_type from flow_run").fetchall() == [("CANCELLED",)]


def kill_9_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (the stages run in process groups of their own)."""
    import psutil

    tree = [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]
    for proc in tree:
        proc.kill()
    psutil.wait_procs(tree, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "kill -9"])
def test_a_stopped_experiment_resumes_in_the_next_run_with_its_overrides(tmp_path, how):
    """An experiment (a run with --set) stopped by SIGTERM, or killed outright, leaves its copy with the
    resume state; the next run with the same overrides takes that state (grpo resumes, not from step 1),
    saves the experiment and leaves no copy behind."""
    repo = stoppable_repo(tmp_path / "repo")
    args = ("--set", "grpo.kl_coef=0.07")

    def copies() -> list[Path]:
        listed = sh(repo, "git", "worktree", "list", "--porcelain").splitlines()
        return [Path(x.split(" ", 1)[1]) for x in listed if x.startswith("worktree ")][1:]

    env = flow_env(repo)
    if how == "SIGTERM":
        code, seconds, output, work = stop_flow_in_grpo(repo, env, signal.SIGTERM, args, lambda: next(iter(copies()), None))
        assert_stopped(work, signal.SIGTERM, code, seconds, output)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "flows.grpo_pipeline", *args], cwd=repo, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while not copies() or not (copies()[0] / "checkpoints" / "grpo.resume" / "step_000003").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        kill_9_tree(proc.pid)
        proc.wait()
        work = copies()[0]
    assert copies() == [work] and (work / "checkpoints" / "grpo.resume" / "step_000003").is_dir()

    second = subprocess.run([sys.executable, "-m", "flows.grpo_pipeline", *args], cwd=repo,
                            env={**env, "GRPO_STEPS": "6"}, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "grpo resumed from step" in second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
    assert "saved: dvc exp show" in second.stdout and copies() == []


# --------------------------------------------------------------------------- a lagging MLflow server

class LaggingProxy:
    """A TCP proxy on 127.0.0.1 that holds each chunk the server sends for `delay` s: a server that
    answers every call, slowly (a loaded host, a far region)."""

    def __init__(self, target_port: int, delay: float):
        self.target, self.delay = target_port, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.delay), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.sock.close()


LOGGING_STAGE = """import sys
from pipeline.core.config import Config, TrackingConfig
from pipeline.tracking import stage_logger
cfg = Config(tracking=TrackingConfig(enabled=True, uri=sys.argv[1], experiment="lag"))
with stage_logger(cfg, sys.argv[2]) as log:
    for step in range(1, int(sys.argv[3]) + 1):
        log.log_metrics({"train/reward": step / 100}, step=step)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end_timeout", [None, "2"])
def test_a_lagging_server_costs_time_not_a_finished_runs_end_or_its_points(tmp_path, mlflow_server, end_timeout):
    """A stage logs 60 points to a server that answers each call 0.25 s late, then ends well: its run
    ends FINISHED with all 60 points, after the next stage's start (its sweep of runs left RUNNING).
    By default the stage waits for the server (a progress line while it does; the old 10 s flush gave
    up, and the sweep marked the run KILLED); with a 2 s bound (GRPO_TRACKING_END_TIMEOUT_S) it saves
    what is left, and the next stage's start (the lag over) delivers it."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import REPO

    proxy = LaggingProxy(int(mlflow_server.rsplit(":", 1)[1]), delay=0.25)
    env = {**base_env(REPO), **({"GRPO_TRACKING_END_TIMEOUT_S": end_timeout} if end_timeout else {})}
    for k in ("MLFLOW_TRACKING_URI", "DVC_ROOT", "GRPO_PARENT_RUN_ID"):
        env.pop(k, None)
    try:
        t0 = time.monotonic()
        first = subprocess.run([sys.executable, "-c", LOGGING_STAGE, proxy.url, "grpo", "60"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=300)
        print(f"the stage took {time.monotonic() - t0:.0f} s against the lagging server; stderr: {first.stderr}")
        assert first.returncode == 0, first.stderr[-3000:]
        pending = list((tmp_path / "mlruns" / "pending").glob("*"))
        proxy.delay = 0.02  # the lag has passed when the next stage starts
        env.pop("GRPO_TRACKING_END_TIMEOUT_S", None)
        second = subprocess.run([sys.executable, "-c", LOGGING_STAGE, proxy.url, "evaluate", "0"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
    finally:
        proxy.close()
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("lag")
    (grpo,) = client.search_runs([exp.experiment_id], "tags.`grpo.stage` = 'grpo'")
    history = client.get_metric_history(grpo.info.run_id, "grpo/reward")
    assert (grpo.info.status, len(history)) == ("FINISHED", 60), (first.stderr, second.stderr)
    assert [m.step for m in history] == list(range(1, 61))
    # waited, saying so (default); or saved what was left (2 s bound), and the next start delivered it
    assert (len(pending) == 1) if end_timeout else (not pending and "is slow:" in first.stderr), first.stderr
    assert not list((tmp_path / "mlruns" / "pending").glob("*"))


# --------------------------------------------------------------------------- a killed serving process

def served_deployment(client, name: str, serve: subprocess.Popen, log: Path, timeout: float = 120):
    """The deployment once `python -m flows.serve` has registered it (failing on its exit or a timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            return client.read_deployment_by_name(name)
        except Exception:  # not registered yet
            time.sleep(0.5)


def wait_run(client, run_id, done, what: str, timeout: float, log: Path):
    """The flow run once `done(run)` holds, polled every 0.5 s; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not done(run := client.read_flow_run(run_id)):
        assert time.monotonic() < deadline, (what, run.state, log.read_text()[-4000:])
        time.sleep(0.5)
    return run


@pytest.mark.slow
@pytest.mark.integration
def test_a_killed_serving_process_leaves_no_ghost_holding_the_slot(tmp_path, prefect_server):
    """kill -9 of `python -m flows.serve` (its process group and the stages' groups) while its run is in
    grpo leaves that run RUNNING, holding the deployment's single slot; serving again ends it Crashed
    (one line), so the next trigger starts within seconds (it waited ~5 min for Prefect's lease) and
    completes, resuming grpo."""
    import contextlib

    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    repo = stoppable_repo(tmp_path / "repo")
    env = flow_env(repo, PREFECT_API_URL=prefect_server["url"])
    cmd = [sys.executable, "-m", "flows.serve", "--name", "itest", "--cron", "0 3 * * *"]
    logs = [tmp_path / "serve1.log", tmp_path / "serve2.log"]
    serve = start(cmd, repo, env, logs[0])
    second = None
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                served_deployment(client, "grpo-pipeline/itest", serve, logs[0])
                ghost = run_deployment("grpo-pipeline/itest", timeout=0)
                deadline = time.monotonic() + 300
                while not (repo / "checkpoints" / "grpo.resume" / "step_000003").exists():
                    assert serve.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
                    time.sleep(0.2)
                kill_9_tree(serve.pid)  # the serving process, its flow-run process and the stages
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
                assert client.read_flow_run(ghost.id).state.is_running()  # nothing told the server

                second = start(cmd, repo, {**env, "GRPO_STEPS": "6"}, logs[1])
                served_deployment(client, "grpo-pipeline/itest", second, logs[1])
                t0 = time.monotonic()
                run = run_deployment("grpo-pipeline/itest", timeout=0)
                wait_run(client, run.id, lambda r: r.state.type.value != "SCHEDULED", "the second run's start",
                         60, logs[1])  # the lease Prefect would wait for is 300 s
                started = time.monotonic() - t0
                state = client.read_flow_run(ghost.id).state
                assert state.is_crashed() and "the serving process was killed" in state.message, state
                lines = [x for x in logs[1].read_text().splitlines() if x.startswith("reconciled run")]
                assert len(lines) == 1 and str(ghost.id) in lines[0] and "Running -> Crashed" in lines[0], lines
                done = wait_run(client, run.id, lambda r: r.state.is_final(), "the second run's end", 300, logs[1])
                assert done.state.is_completed(), (done.state, logs[1].read_text()[-4000:])
        print(f"the run after the kill started {started:.1f} s after its trigger")
        assert "grpo resumed from step" in logs[1].read_text()
    finally:
        for proc in (serve, second):
            if proc is not None:
                stop(proc)
        kill_leftovers(repo / "out")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
@pytest.mark.integration
def test_reconcile_ends_only_this_hosts_dead_runs_and_never_frees_a_live_runs_slot(tmp_path, prefect_server, capsys):
    """Against a real server, runs of a deployment with a limit of 5, each Running with the slot and
    lease the server gave it: only the run whose recorded process is gone from this host ends (Crashed,
    a Cancelling one Cancelled) and gives its slot back; a live process's run, another host's, a bare
    pid and a run with no record stay. A dead run whose lease is gone stays while the slots counted could
    all be live runs' (ending it would free one of theirs), and ends once the count is one the gone
    lease left behind."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling, Completed, Pending, Running

    from flows.reconcile import reconcile

    host, dead = socket.gethostname(), dead_pid()
    records = {"ghost": f"{host}:{dead}", "cancelling": f"{host}:{dead}", "live": f"{host}:{os.getpid()}",
               "elsewhere": f"not-{host}:{dead}", "bare": str(dead), "none": None}
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"]}):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("grpo-pipeline")
            dep = client.create_deployment(flow_id, "unit", concurrency_limit=len(records))
            runs = {}
            for what, record in records.items():
                run = client.create_flow_run_from_deployment(dep)
                for state in (Pending(), Running(), *([Cancelling()] if what == "cancelling" else [])):
                    assert client.set_flow_run_state(run.id, state).status.value == "ACCEPT", what
                if record:
                    client.update_flow_run(run.id, infrastructure_pid=record)
                runs[what] = run.id

            def slots() -> int:
                return client.read_deployment_by_name("grpo-pipeline/unit").global_concurrency_limit.active_slots

            def state_of(what: str):
                return client.read_flow_run(runs[what]).state

            assert slots() == len(records)
            assert sorted(reconcile("grpo-pipeline/unit")) == sorted(str(runs[w]) for w in ("ghost", "cancelling"))
            assert state_of("ghost").is_crashed() and state_of("cancelling").is_cancelled()
            assert all(state_of(w).is_running() for w in ("live", "elsewhere", "bare", "none"))
            assert slots() == len(records) - 2
            out = capsys.readouterr().out.splitlines()
            assert len(out) == 2 and all(x.startswith("reconciled run") for x in out), out

            # a dead run whose lease the server reclaimed (what its lease reaper does) while others hold slots
            client.update_flow_run(runs["elsewhere"], infrastructure_pid=f"{host}:{dead}")
            client.release_concurrency_slots_with_lease(state_of("elsewhere").state_details.deployment_concurrency_lease_id)
            assert slots() == len(records) - 3 and reconcile("grpo-pipeline/unit") == []
            assert state_of("elsewhere").is_running() and slots() == len(records) - 3
            assert capsys.readouterr().out.startswith(f"left run '{client.read_flow_run(runs['elsewhere']).name}'")
            # the others end; a slot still counted without its lease (a restarted server forgets leases)
            for what in ("live", "bare", "none"):
                client.set_flow_run_state(runs[what], Completed())
            limit = client.read_deployment_by_name("grpo-pipeline/unit").global_concurrency_limit
            client.increment_concurrency_slots([limit.name], slots=1, mode="concurrency")
            assert slots() == 1 and reconcile("grpo-pipeline/unit") == [str(runs["elsewhere"])]
            assert state_of("elsewhere").is_crashed() and slots() == 0
