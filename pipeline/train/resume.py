"""Resumable training state: a trainer's own state, the policy, the optimizer and every RNG.

The trainer's state is any dataclass of JSON values (counters, a metric series); this module
knows nothing else about it. ``save_resume`` writes it with the weights, the optimizer state, the
global RNGs and an optional sampling generator to ``folder/step_NNNNNN`` through
:func:`pipeline.train.state.save_training_state` (safetensors + JSON, atomic, verified on load, no
pickle) and keeps the newest ``keep_last`` saved under the same key. ``load_resume`` restores the
newest intact one.

Each state carries a compatibility key (:func:`resume_key`: the params and the bytes of the
inputs it was made from). ``load_resume`` ignores a state with another key, so a state left by
other params or inputs never leaks into a run; whether a stage is up to date is not decided here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.core import distributed as dist_utils
from pipeline.core.errors import CheckpointError, InputError
from pipeline.core.files import sha256
from pipeline.model.policy import Policy
from pipeline.train.manifest import TRAIN_JSON
from pipeline.train.state import capture_rng_state, load_training_state, restore_rng_state, save_training_state

log = logging.getLogger(__name__)
State = TypeVar("State")


def resume_key(params: Mapping[str, Any], files: Iterable[Path]) -> str:
    """SHA-256 over `params` (JSON, sorted keys) and the SHA-256 of each file, in the given order."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for path in files:
        h.update(sha256(path).encode())
    return h.hexdigest()


def save_resume(folder: Path, step: int, key: str, state: Any, policy: Policy, optimizer: torch.optim.Optimizer,
                generator: torch.Generator | None, keep_last: int,
                rank_generators: list[torch.Tensor] | None = None) -> Path:
    """Write `state` (a dataclass) with weights, optimizer and RNGs to folder/step_NNNNNN atomically.
    `rank_generators`: every rank's sampling generator state, in rank order (DDP: rank 0 writes
    the state, and each rank resumes with its own generator, not rank 0's)."""
    rng = {**({"sampling": generator.get_state()} if generator is not None else {}), **capture_rng_state()}
    if rank_generators is not None:
        rng["sampling_by_rank"] = list(rank_generators)
    out = save_training_state(folder / f"step_{step:06d}", policy, optimizer, None, rng,
                              {"key": key, "state": dataclasses.asdict(state)})
    # keep the newest `keep_last` states of this run's key; states saved under other params (a run
    # changed after a crash) are not counted, so they cannot push this run's new states out
    ours = [p for p in sorted(folder.glob("step_*")) if (_peek(p) or {}).get("key") == key]
    for old in ours[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _peek(candidate: Path) -> dict[str, Any] | None:
    """The key and state stored in a candidate folder, or None if unreadable."""
    try:
        extra = json.loads((candidate / TRAIN_JSON).read_text())["extra"]
        return extra if isinstance(extra["key"], str) and isinstance(extra["state"], dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_resume(folder: Path, key: str, state_type: type[State], policy: Policy, optimizer: torch.optim.Optimizer,
                generator: torch.Generator | None, rank: int = 0) -> State | None:
    """The newest intact state in `folder` saved under `key`, with weights, optimizer and RNGs
    restored in place (the sampling generator from this `rank`'s own saved state, if saved per
    rank); None (nothing restored) if there is none."""
    if not folder.is_dir():
        return None
    for candidate in sorted(folder.glob("step_*"), reverse=True):
        extra = _peek(candidate)
        if extra is None or extra["key"] != key:
            log.info("ignoring resume state %s (other inputs or params, or unreadable)", candidate)
            continue
        try:
            state = state_type(**extra["state"])  # before any weight is touched
            rng = load_training_state(candidate, policy, optimizer)["rng_state"]
        except (CheckpointError, TypeError) as exc:
            log.info("ignoring resume state %s (%s)", candidate, exc)
            continue
        sampling = rng.pop("sampling", None)
        by_rank = rng.pop("sampling_by_rank", None)
        if by_rank is not None:
            if rank >= len(by_rank):
                log.info("ignoring resume state %s (saved by %d ranks, this is rank %d)", candidate, len(by_rank), rank)
                continue
            sampling = by_rank[rank]
        if generator is not None and sampling is not None:
            generator.set_state(sampling)
        restore_rng_state(rng)
        log.info("resuming from %s", candidate)
        return state
    return None


def check_ranks_agree(step: int | None, folder: Path, stage: str) -> None:
    """Every rank resumes from the same state, or none does: each reads `folder` itself, so under several
    processes (one machine or several) they must see the same folder. `step`: this rank's resumed step,
    None for none. An InputError on every rank where they differ, before any of them trains."""
    mine = -1 if step is None else step
    hi, lo = dist_utils.max_across_ranks(mine), -dist_utils.max_across_ranks(-mine)
    if hi != lo:
        raise InputError(f"{folder}: the ranks found different resume states (steps {lo} to {hi}; -1: none): every "
                         f"rank reads the {stage} stage's resume state, so all must see the same folder: one shared "
                         f"working directory, or rank 0's {folder} copied to every machine before the re-run")
