"""A flow run with overrides as a DVC experiment, the way ``dvc exp run --temp -S`` makes one.

``experiment_copy(root, name, overrides)`` yields a git worktree of ``root`` (``HEAD`` plus the
workspace's uncommitted state: modified and untracked files, ``dvc.lock``, the metrics and plots)
that shares ``root``'s DVC cache, so unchanged stages are skipped or checked out, never re-run.
The overrides are applied to its ``params.yaml`` by DVC's own ``-S`` code (comments kept); a GSM8K
source DVC cannot hash (a hub id, a missing path) stops there in one line. The caller runs the
stages there; on success the result is saved with ``dvc exp save -n <name>``: a git worktree shares
the repository's refs, so ``dvc exp show`` in ``root`` lists it beside experiments made by hand.
The worktree is removed, and ``root`` is left as it was found, unless the run stopped early with
training to resume (``checkpoints/<stage>.resume`` in it): a stopped or killed run's copy stays,
and the next run with the same overrides takes its resume states and removes it, so it resumes
where the stopped one was instead of starting again (each stage still refuses a state made from
other params or inputs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.core.files import did_you_mean


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


def check_gsm8k_source(work: Path, overrides: list[str] | None = None) -> None:
    """DVC hashes ``data.gsm8k_source`` as the prepare stage's dependency (``dvc.yaml``) and stops on a
    missing one before the stage starts (``[Errno 2] No such file or directory``); a source that is not
    a file or folder of ``work`` (a hub id, a mistyped path) is one line here, before any stage."""
    from pipeline.core.config_loading import load_config

    source = load_config(work / "params.yaml", overrides).data.gsm8k_source
    if not (work / source).exists():
        raise InputError(f"data.gsm8k_source = {source!r}: no such file or folder; a run through DVC hashes the "
                         "GSM8K source as the prepare stage's dependency, so it must be a local copy (a folder with "
                         "train.jsonl and test.jsonl, or the dataset's Parquet files); a hub id is read only outside "
                         f"DVC (python -m pipeline all --set data.gsm8k_source=ID){did_you_mean(source, work)}")


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
    # DVC stages what it changes (dvc.lock, .gitignore) in this throwaway worktree, where `dvc exp save`
    # commits it, instead of printing "To track the changes with git, run: git add ..." after every stage:
    # advice that, followed in a copy about to be deleted, would be wrong
    _run(_dvc("config", "--local", "core.autostage", "true"), dst)


def copy_key(root: Path, overrides: list[str]) -> str:
    """What names the copies of one experiment: the repository and the overrides (in any order)."""
    return hashlib.sha256(json.dumps([str(root), sorted(overrides)]).encode()).hexdigest()[:12]


def _resume_states(work: Path) -> list[Path]:
    folder = work / "checkpoints"
    return [p for p in folder.glob("*.resume") if p.is_dir() and any(p.iterdir())] if folder.is_dir() else []


def _earlier_copies(root: Path, key: str) -> list[Path]:
    """Worktrees of ``root`` left by stopped or killed runs with the same overrides (the caller holds
    ``root``'s lock, so none of them is in use)."""
    listed = _run(["git", "worktree", "list", "--porcelain"], root).stdout
    paths = [Path(line[len("worktree "):]) for line in listed.splitlines() if line.startswith("worktree ")]
    return [p for p in paths if p.parent.name.startswith(f"grpo-exp-{key}-")]


def _take_resume_states(root: Path, key: str, work: Path) -> None:
    """Move the resume states of earlier copies of this experiment into ``work``; remove those copies."""
    for old in [p for p in _earlier_copies(root, key) if p.resolve() != work.resolve()]:
        for state in _resume_states(old):
            if not (work / "checkpoints" / state.name).exists():
                (work / "checkpoints").mkdir(exist_ok=True)
                shutil.move(str(state), work / "checkpoints" / state.name)
        _remove_copy(root, old)


def _remove_copy(root: Path, work: Path) -> None:
    _run(["git", "worktree", "remove", "--force", str(work)], root, check=False)
    shutil.rmtree(work.parent, ignore_errors=True)
    _run(["git", "worktree", "prune"], root, check=False)


@contextlib.contextmanager
def experiment_copy(root: str | Path, name: str, overrides: list[str]) -> Iterator[Path]:
    """A temporary working copy of ``root`` with ``overrides`` applied, holding the resume states an
    earlier stopped copy with the same overrides left; removed on exit, unless the run stopped early
    with a resume state in it (then the next such run takes it)."""
    root = Path(root).resolve()
    if _run(["git", "rev-parse", "HEAD"], root, check=False).returncode != 0:
        raise InputError(f"{root}: a run with overrides is saved as a DVC experiment, which needs a git "
                         f"repository with at least one commit")
    key = copy_key(root, overrides)
    tmp = Path(tempfile.mkdtemp(prefix=f"grpo-exp-{key}-{name}-"))
    work = tmp / "repo"
    _run(["git", "worktree", "add", "--detach", str(work), "HEAD"], root)
    keep = False
    try:
        _copy_workspace_state(root, work)
        _share_cache(root, work)
        _run(_dvc("checkout", "--allow-missing"), work, check=False)  # what is cached; the rest re-runs
        if overrides:
            apply_overrides(work / "params.yaml", overrides)
        check_gsm8k_source(work)
        _take_resume_states(root, key, work)
        yield work
    except BaseException as exc:
        # stopped mid-training: the next run with these overrides resumes; finished but not saved: kept whole
        keep = bool(_resume_states(work)) or isinstance(exc, ExperimentNotSaved)
        raise
    finally:
        if not keep:
            _remove_copy(root, work)


def push_experiment(work: Path, name: str, remote: str) -> str:
    """``dvc exp push`` experiment ``name`` to git remote ``remote``: its git ref (params, ``dvc.lock``,
    metrics, plots) there and its cached outputs to the repository's default DVC remote, so any clone
    gets it with ``dvc exp pull <remote> <name>``. One line naming the remote where it fails."""
    res = _run(_dvc("exp", "push", remote, name), work, check=False)
    if res.returncode != 0:
        why = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise InputError(f"experiment {name}: dvc exp push {remote} failed: {why[0]}")
    return remote


class ExperimentNotSaved(InputError):
    """``dvc exp save`` refused a finished run, a stop the user acts on (one line): its copy is kept
    (``experiment_copy``), so nothing is lost."""


def save_experiment(work: Path, name: str) -> str:
    """``dvc exp save`` the copy's state (params, dvc.lock, metrics, plots) as experiment ``name``.

    The save names the pipeline's own ``dvc.yaml`` (as ``dvc exp run`` commits only the stages it
    reproduced): without a target DVC commits every stage of every ``dvc.yaml`` in the project, and a
    recipe's (``recipes/*/dvc.yaml``) outputs, such as its downloaded model, are missing from any clone
    that never ran it. When the save still fails, the copy stays where it is and the error names it, so
    a run's half hour of training is never deleted with it."""
    res = _run(_dvc("exp", "save", "--force", "-n", name, "-m", f"dvc: flow run {name}",
                    "--include-untracked", "metrics", "--include-untracked", "plots", "dvc.yaml"), work, check=False)
    if res.returncode != 0:
        why = ((res.stderr or res.stdout).strip().splitlines() or ["no output"])[-1].removeprefix("ERROR: ")
        raise ExperimentNotSaved(f"experiment {name}: {why}; the run's outputs are kept in {work} "
                                 f"(`dvc exp save -n {name} dvc.yaml` there saves them)")
    return name
