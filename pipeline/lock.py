"""One pipeline run per workspace: a lock file naming its holder (pid, host, start time, what).

Every stage function takes it (``pipeline.stages.stage_function``), so a stage started by the CLI,
by ``dvc repro`` or by a Prefect task cannot run beside another stage in the same folder: the
second one stops before touching anything, with one line naming the running one (exit 2). A lock
left by a killed process (its pid is gone) is stale and is cleared by the next run.

A process that holds the lock exports its token (``GRPO_LOCK_TOKEN``) while it holds it, so its own
children (torchrun ranks, ``dvc repro`` under a flow that holds the lock) pass through.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import InputError

LOCK_FILE = ".pipeline.lock"
TOKEN_ENV = "GRPO_LOCK_TOKEN"


class WorkspaceBusyError(InputError):
    """Another pipeline run holds this workspace's lock."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_holder(root: str | Path = ".") -> dict[str, Any] | None:
    """The lock's content, or None when the workspace is free (a half-written lock reads as empty)."""
    try:
        return json.loads((Path(root) / LOCK_FILE).read_text() or "{}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def is_stale(holder: dict[str, Any]) -> bool:
    """A lock whose holder is gone: its pid is dead on this host (another host's lock is never stale)."""
    if not holder.get("pid"):
        return False  # being written right now
    return holder.get("host") == socket.gethostname() and not pid_alive(int(holder["pid"]))


def describe(holder: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('what', 'a run')} (pid {holder.get('pid')} on {holder.get('host')}, started {started})"


def check_free(root: str | Path = ".") -> None:
    """Raise :class:`WorkspaceBusyError` now if a live run holds the workspace (a cheap early check
    for callers with a slow start; the lock itself is still taken where the work happens)."""
    current = read_holder(root)
    if current and not is_stale(current) and current.get("token") != os.environ.get(TOKEN_ENV):
        raise _busy(root, current)


def _busy(root: str | Path, holder: dict[str, Any]) -> WorkspaceBusyError:
    return WorkspaceBusyError(f"{Path(root).resolve()}: another run is in progress here: {describe(holder)}; "
                              f"wait for it to finish or stop it")


def _try_create(path: Path, holder: dict[str, Any]) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(holder, f)
    return True


@contextlib.contextmanager
def workspace_lock(what: str, root: str | Path = ".") -> Iterator[dict[str, Any]]:
    """Hold the workspace lock for the block; raise :class:`WorkspaceBusyError` if a live run holds it."""
    path = Path(root) / LOCK_FILE
    current = read_holder(root)
    token = os.environ.get(TOKEN_ENV)
    if current and token and current.get("token") == token:  # our own parent holds it
        yield current
        return
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "what": what,
              "token": uuid.uuid4().hex}
    for _ in range(2):
        if _try_create(path, holder):
            break
        current = read_holder(root)
        if current is None:
            continue  # released in between: try again
        if not is_stale(current):
            raise _busy(root, current)
        with contextlib.suppress(FileNotFoundError):  # a killed run's lock: clear it
            path.unlink()
    else:
        raise WorkspaceBusyError(f"{path}: could not take the workspace lock (another run is starting)")
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = holder["token"]
    try:
        yield holder
    finally:
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved
        if (read_holder(root) or {}).get("token") == holder["token"]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
