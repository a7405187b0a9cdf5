"""The workspace lock is the OS's (fcntl.flock): at most one holder at a time, even when many runs
start together beside a killed run's lock file; a killed holder frees it at once; a lock file that no
live process holds blocks nothing, whatever pid it names; a read-only workspace is one line, exit 2."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.lock import LOCK_FILE, WorkspaceBusyError, check_free, read_holder, workspace_lock
from tests.conftest import QUIET_ENV, REPO

ENV = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}
HOLD = "import time\nfrom pipeline.core.lock import workspace_lock\nwith workspace_lock('stage sft'):\n" \
       "    print('held', flush=True); time.sleep(60)"
ROUNDS, RACERS = 400, 8


def _hold_until_killed(root: str, ready) -> None:
    with workspace_lock("killed run", root):
        ready.set()
        time.sleep(60)


def _racer(root: str, gates, inside, most, wins) -> None:
    """Each round: try the lock once as the gate opens; a winner keeps it until every racer has tried."""
    start, tried, done = gates
    for r in range(ROUNDS):
        start.wait()
        try:
            with workspace_lock("racer", root):
                with inside.get_lock():
                    inside.value += 1
                    most.value = max(most.value, inside.value)
                wins[r] += 1
                tried.wait()
                with inside.get_lock():
                    inside.value -= 1
        except WorkspaceBusyError:
            tried.wait()
        done.wait()


@pytest.mark.slow  # 400 rounds of 9 forked processes, about 25 s on 2 cores: over the marker's 10 s
def test_runs_racing_over_a_killed_runs_lock_hold_it_one_at_a_time(tmp_path):
    """Each round a holder is killed (-9) inside the lock, then RACERS processes try it together:
    exactly one wins the round, and no two are ever inside at once."""
    ctx = multiprocessing.get_context("fork")
    gates = [ctx.Barrier(n, timeout=30) for n in (RACERS + 1, RACERS, RACERS + 1)]
    inside, most, wins = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Array("i", ROUNDS)
    racers = [ctx.Process(target=_racer, args=(str(tmp_path), gates, inside, most, wins)) for _ in range(RACERS)]
    for p in racers:
        p.start()
    try:
        for _ in range(ROUNDS):
            ready = ctx.Event()
            killed = ctx.Process(target=_hold_until_killed, args=(str(tmp_path), ready))
            killed.start()
            assert ready.wait(30)
            os.kill(killed.pid, signal.SIGKILL)
            killed.join()
            assert read_holder(tmp_path)["pid"] == killed.pid  # its file stays behind, naming a dead pid
            gates[0].wait()
            gates[2].wait()
    finally:
        for p in racers:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in racers] == [0] * RACERS
    assert list(wins) == [1] * ROUNDS, f"rounds won by 0 or 2+: {[i for i, n in enumerate(wins) if n != 1]}"
    assert most.value == 1, f"{most.value} holders at once"


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_killed_holder_frees_the_lock_at_once(tmp_path):
    """kill -9: the lock is free as soon as the process is gone, before anyone reaps it (its pid still
    exists as a zombie, so no liveness check could tell)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkspaceBusyError, match=rf"stage sft \(pid {holder.pid} "):
            check_free(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _zombie(holder.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        check_free(tmp_path)
        with workspace_lock("next run", tmp_path) as mine:
            assert read_holder(tmp_path)["token"] == mine["token"]
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_naming_a_live_unrelated_pid_blocks_nothing(tmp_path):
    """The file only describes the holder; the OS lock is what counts. A file left behind that names a
    pid now reused by some other live process (here: this test's own) is taken over."""
    (tmp_path / LOCK_FILE).write_text('{"pid": %d, "host": "%s", "started": 0, "what": "stage grpo", "token": "x"}'
                                      % (os.getpid(), os.uname().nodename))
    check_free(tmp_path)
    with workspace_lock("stage sft", tmp_path) as mine:
        assert read_holder(tmp_path)["token"] == mine["token"]
        with workspace_lock("stage sft (torchrun rank)", tmp_path):  # our own children pass through
            pass
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_holders_children_pass_through_and_others_are_refused(tmp_path):
    """A child started with the holder's environment (a torchrun rank, `dvc repro` under the flow)
    passes through the lock; the same command without the holder's token is refused."""
    from pipeline.core.lock import TOKEN_ENV

    child = [sys.executable, "-c", "from pipeline.core.lock import workspace_lock\n"
             "with workspace_lock('stage sft (rank 1)'):\n    print('through')"]
    with workspace_lock("stage sft (torchrun, 2 processes)", tmp_path):
        ours = subprocess.run(child, cwd=tmp_path, env={**ENV, TOKEN_ENV: os.environ[TOKEN_ENV]},
                              capture_output=True, text=True, timeout=60)
        other = subprocess.run(child, cwd=tmp_path, env={k: v for k, v in ENV.items() if k != TOKEN_ENV},
                               capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and ours.stdout.strip() == "through", ours.stderr[-2000:]
    assert other.returncode != 0 and "torchrun, 2 processes" in other.stderr, other.stderr[-2000:]


def test_a_held_lock_not_yet_described_says_so_and_an_unheld_empty_file_blocks_nothing(tmp_path):
    """A holder between taking the lock and writing its description (here: a bare flock on an empty
    file) is a run taking the lock; the same empty file once nobody holds it is no lock at all."""
    lock = tmp_path / LOCK_FILE
    lock.touch()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(WorkspaceBusyError, match="taking the lock"):
            with workspace_lock("stage grpo", tmp_path):
                pass
    finally:
        os.close(fd)
    with workspace_lock("stage grpo", tmp_path) as mine:
        assert read_holder(tmp_path)["token"] == mine["token"]


def _read_only_cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` in `folder` made read-only: by its mode, or for root (whom modes do
    not stop) by a read-only bind mount in a mount namespace of its own."""
    cmd = [sys.executable, "-m", "pipeline", *args]
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            return subprocess.run(cmd, cwd=folder, env=ENV, capture_output=True, text=True, timeout=120)
        finally:
            folder.chmod(0o755)
    if not shutil.which("unshare"):
        pytest.skip("running as root without unshare: no way to make a folder read-only")
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && cd "$1" && shift && exec "$@"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(folder), *cmd], env=ENV,
                          capture_output=True, text=True, timeout=120)
    if "mount" in proc.stderr or "unshare" in proc.stderr:
        pytest.skip(f"cannot mount read-only here: {proc.stderr.strip()[:200]}")
    return proc


def test_a_read_only_workspace_is_one_line_naming_the_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    shutil.copy(REPO / "configs" / "smoke.yaml", folder / "params.yaml")
    proc = _read_only_cli(folder, "prepare")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(folder) in lines[0] and LOCK_FILE in lines[0], proc.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["params.yaml"]
