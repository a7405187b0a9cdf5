"""One pipeline run per workspace: a lock file naming its holder (pid, host, start time, what).

Every stage function takes it (``pipeline.stages.stage_function``), so a stage started by the CLI,
by ``dvc repro`` or by a Prefect task cannot run beside another stage in the same folder: the
second one stops before touching anything, with one line naming the running one (exit 2). A lock
left by a killed process (its pid is gone) is stale and is cleared by the next run.

The lock appears whole: its content is written to a temporary file first and hard-linked into
place (an exclusive create), so a full disk or a kill while it is written leaves no lock at all.
Where hard links fail (some network and FUSE file systems) it is created empty and then written;
an empty lock older than ``EMPTY_STALE_S`` is then taken for one whose writer died.

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
EMPTY_STALE_S = 60.0


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


def is_stale(holder: dict[str, Any], root: str | Path | None = None) -> bool:
    """A lock whose holder is gone: its pid is dead on this host (another host's lock is never stale),
    or, given the workspace `root`, a lock still empty `EMPTY_STALE_S` after it was created."""
    if not holder.get("pid"):
        if root is None:
            return False
        try:  # being written right now, unless its writer died before writing
            return time.time() - (Path(root) / LOCK_FILE).stat().st_mtime > EMPTY_STALE_S
        except OSError:
            return False
    return holder.get("host") == socket.gethostname() and not pid_alive(int(holder["pid"]))


def describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "a run that is taking the lock (it is not written yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('what', 'a run')} (pid {holder.get('pid')} on {holder.get('host')}, started {started})"


def check_free(root: str | Path = ".") -> None:
    """Raise :class:`WorkspaceBusyError` now if a live run holds the workspace (a cheap early check
    for callers with a slow start; the lock itself is still taken where the work happens)."""
    current = read_holder(root)
    if current and not is_stale(current, root) and current.get("token") != os.environ.get(TOKEN_ENV):
        raise _busy(root, current)


def _busy(root: str | Path, holder: dict[str, Any]) -> WorkspaceBusyError:
    return WorkspaceBusyError(f"{Path(root).resolve()}: another run is in progress here: {describe(holder)}; "
                              f"wait for it to finish or stop it")


def _try_create(path: Path, holder: dict[str, Any]) -> bool:
    """Create the lock with its content in one step; False if it exists."""
    tmp = path.with_name(f"{path.name}.{holder['token']}.tmp")
    try:
        tmp.write_text(json.dumps(holder))  # a full disk fails here, before any lock exists
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: an exclusive create, then the content
            pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(holder, f)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
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
        if not is_stale(current, root):
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
