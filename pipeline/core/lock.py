"""One pipeline run per workspace: an OS lock (``fcntl.flock``) on ``.pipeline.lock``.

Every stage function takes it (``pipeline.stages.stage_function``), so a stage started by the CLI,
by ``dvc repro`` or by a Prefect task cannot run beside another stage in the same folder: the
second one stops before touching anything, with one line naming the running one (exit 2).

The lock is the flock, and the kernel drops it when its holder exits, however it dies (kill -9
included): there is no stale lock to judge and no pid to check, so nothing can delete a lock that
another run has just taken. The file's content (what, pid, host, start time) only describes the
holder for the busy message; a file a killed run left behind is simply locked by the next run. A
holder removes the file while it still holds the lock, so a run that locked a file just removed
this way sees that the path no longer names it and starts again on the file there now.

``fcntl.flock`` itself, not the ``filelock`` package: this module writes the holder's description
into the locked file and decides its own pass-through, and filelock falls back to a soft lock
(existence of a file, with stale-lock judging) where flock is missing; here that is one line instead.
Not ``lockf`` (POSIX record locks) either: a process drops those when it closes any descriptor of
the file, as a nested block that looks at the lock does.

A process that holds the lock exports its token (``GRPO_LOCK_TOKEN``) while it holds it, so its own
children (torchrun ranks, ``dvc repro`` under a flow that holds the lock) pass through: a lock held
by another open file whose content carries the caller's token is its parent's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError

LOCK_FILE = ".pipeline.lock"
TOKEN_ENV = "GRPO_LOCK_TOKEN"


class WorkspaceBusyError(InputError):
    """Another pipeline run holds this workspace's lock."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (tracking's bookkeeping of its runs; the
    lock never asks: a pid can be reused, the OS lock cannot outlive its holder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_holder(root: str | Path = ".") -> dict[str, Any] | None:
    """The lock file's description of its last holder, or None without a file (a half-written one
    reads as empty). Whether anyone holds the lock now is the OS lock's answer, not this."""
    try:
        return json.loads((Path(root) / LOCK_FILE).read_text() or "{}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "a run that is taking the lock (it is not written yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('what', 'a run')} (pid {holder.get('pid')} on {holder.get('host')}, started {started})"


def _ours(holder: dict[str, Any]) -> bool:
    """Whether the holder is this process or an ancestor (its token is in our environment)."""
    token = os.environ.get(TOKEN_ENV)
    return bool(token) and holder.get("token") == token


def _busy(root: str | Path, holder: dict[str, Any]) -> WorkspaceBusyError:
    return WorkspaceBusyError(f"{Path(root).resolve()}: another run is in progress here: {describe(holder)}; "
                              f"wait for it to finish or stop it")


def _unusable(root: str | Path, exc: OSError) -> InputError:
    return InputError(f"{Path(root).resolve()}: cannot take the workspace lock {LOCK_FILE} here "
                      f"({exc.strerror or exc}); run in a writable folder on a file system with file locks")


def _flock(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    """Take the OS lock on `fd` without waiting; False while another open file holds it."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _names(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a holder removes the file as it releases it)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def check_free(root: str | Path = ".") -> None:
    """Raise :class:`WorkspaceBusyError` now if another run holds the workspace (a cheap early check
    for callers with a slow start; the lock itself is still taken where the work happens)."""
    try:
        fd = os.open(Path(root) / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file: free; an unreadable one: workspace_lock says why
        return
    try:
        if _flock(fd, fcntl.LOCK_SH):  # a probe: closing the file drops it
            return
    finally:
        os.close(fd)
    holder = read_holder(root) or {}
    if not _ours(holder):
        raise _busy(root, holder)


def _acquire(path: Path) -> int | None:
    """An open descriptor of `path` holding its OS lock, or None while another open file holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _flock(fd)
            if locked and _names(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if not locked:
            return None
        # locked a file its holder removed as it released it: lock the one there now


def _release(fd: int, path: Path) -> None:
    """Remove the file, then drop the lock (in this order: whoever locks the removed file retries)."""
    try:
        if _names(fd, path):
            path.unlink()
    finally:
        os.close(fd)


def _take(what: str, root: str | Path) -> tuple[int | None, dict[str, Any]]:
    """(descriptor, holder): the lock taken and described in its file, or (None, the file's description)
    while another run holds it. A folder that cannot hold the lock is one InputError line."""
    path = Path(root) / LOCK_FILE
    try:
        fd = _acquire(path)
    except OSError as exc:
        raise _unusable(root, exc) from None
    if fd is None:
        return None, read_holder(root) or {}
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "what": what,
              "token": uuid.uuid4().hex}
    try:
        os.ftruncate(fd, 0)  # a reader sees nothing rather than the previous holder's description
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    except OSError as exc:  # a full disk or a file-size limit: no lock, and no file, left behind
        _release(fd, path)
        raise _unusable(root, exc) from None
    return fd, holder


@contextlib.contextmanager
def workspace_lock(what: str, root: str | Path = ".") -> Iterator[dict[str, Any]]:
    """Hold the workspace lock for the block; raise :class:`WorkspaceBusyError` if another run holds
    it. Inside a block of our own or our parent's, pass through."""
    fd, holder = _take(what, root)
    if fd is None:
        if not _ours(holder):
            raise _busy(root, holder)
        yield holder
        return
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = holder["token"]
    try:
        yield holder
    finally:
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved
        _release(fd, Path(root) / LOCK_FILE)
