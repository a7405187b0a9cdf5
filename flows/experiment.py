"""A flow run with overrides as a DVC experiment, the way ``dvc exp run --temp -S`` makes one.

``experiment_copy(root, name, overrides)`` yields a git worktree of ``root`` (``HEAD`` plus the
workspace's uncommitted state: modified and untracked files, ``dvc.lock``, the metrics and plots)
that shares ``root``'s DVC cache, so unchanged stages are skipped or checked out, never re-run.
The overrides are applied to its ``params.yaml`` by DVC's own ``-S`` code (comments kept); a GSM8K
source DVC cannot hash (a hub id, a missing path) stops there in one line. The caller runs the
stages there; on success the result is saved with ``dvc exp save -n <name>``: a git worktree shares
the repository's refs, so ``dvc exp show`` in ``root`` lists it beside experiments made by hand.
The worktree is removed either way: ``root`` is left as it was found.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import InputError


def _run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed in {cwd}: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc


def _dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def exp_name(text: str) -> str:
    """A valid experiment (git ref) name from a flow-run name."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")
    return name or "prefect-run"


def apply_overrides(params: Path, overrides: list[str]) -> None:
    """Set ``section.key=value`` overrides in a params file as ``dvc exp run -S`` does (comments kept);
    a key the file lacks is one line naming it."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides as dvc_apply

    try:
        dvc_apply(params, list(overrides))
    except InvalidArgumentError as exc:
        cause = exc.__cause__ or exc
        raise InputError(f"{params.name}: cannot apply {' '.join(overrides)}: {str(cause).splitlines()[0]}") from None


def check_gsm8k_source(work: Path) -> None:
    """DVC hashes ``data.gsm8k_source`` as the prepare stage's dependency (``dvc.yaml``) and stops on a
    missing one before the stage starts (``[Errno 2] No such file or directory``); a source that is not
    a file or folder of ``work`` (a hub id, a mistyped path) is one line here, before any stage."""
    from pipeline.config_loading import load_config

    source = load_config(work / "params.yaml").data.gsm8k_source
    if not (work / source).exists():
        raise InputError(f"data.gsm8k_source = {source!r}: no such file or folder; a run through DVC hashes the "
                         "GSM8K source as the prepare stage's dependency, so it must be a local copy (a folder with "
                         "train.jsonl and test.jsonl, or the dataset's Parquet files); a hub id is read only outside "
                         "DVC (python -m pipeline all --set data.gsm8k_source=ID)")


def _copy_workspace_state(root: Path, dst: Path) -> None:
    """Modified and untracked (not ignored) files of ``root`` into ``dst``: the workspace as it is."""
    listed = _run(["git", "ls-files", "-z", "--modified", "--others", "--exclude-standard"], root).stdout
    for rel in filter(None, listed.split("\0")):
        src = root / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _share_cache(root: Path, dst: Path) -> None:
    cache = _run(_dvc("cache", "dir"), root).stdout.strip() or str(root / ".dvc" / "cache")
    local = root / ".dvc" / "config.local"
    if local.is_file():  # the user's local remotes and settings
        shutil.copy2(local, dst / ".dvc" / "config.local")
    _run(_dvc("cache", "dir", "--local", cache), dst)


@contextlib.contextmanager
def experiment_copy(root: str | Path, name: str, overrides: list[str]) -> Iterator[Path]:
    """A temporary working copy of ``root`` with ``overrides`` applied; removed on exit."""
    root = Path(root).resolve()
    if _run(["git", "rev-parse", "HEAD"], root, check=False).returncode != 0:
        raise InputError(f"{root}: a run with overrides is saved as a DVC experiment, which needs a git "
                         f"repository with at least one commit")
    tmp = Path(tempfile.mkdtemp(prefix=f"grpo-exp-{name}-"))
    work = tmp / "repo"
    _run(["git", "worktree", "add", "--detach", str(work), "HEAD"], root)
    try:
        _copy_workspace_state(root, work)
        _share_cache(root, work)
        _run(_dvc("checkout", "--allow-missing"), work, check=False)  # what is cached; the rest re-runs
        apply_overrides(work / "params.yaml", overrides)
        check_gsm8k_source(work)
        yield work
    finally:
        _run(["git", "worktree", "remove", "--force", str(work)], root, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        _run(["git", "worktree", "prune"], root, check=False)


def save_experiment(work: Path, name: str) -> str:
    """``dvc exp save`` the copy's state (params, dvc.lock, metrics, plots) as experiment ``name``."""
    _run(_dvc("exp", "save", "--force", "-n", name, "--include-untracked", "metrics", "--include-untracked", "plots"),
         work)
    return name
