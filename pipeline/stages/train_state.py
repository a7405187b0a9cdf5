"""Resumable GRPO state (via pipeline.checkpoint: safetensors + JSON, no pickle), the prompt sampler
and batch helpers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.checkpoint import (TRAIN_JSON, capture_rng_state, load_training_state, restore_rng_state,
                                 save_training_state)
from pipeline.errors import CheckpointError
from pipeline.rollout import Rollout

if TYPE_CHECKING:
    from pipeline.stages.train import GRPOTrainer


class PromptSampler:
    """Seeded epoch-wise permutations of row indices; (epoch, pos) is the whole state."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            take = min(k - len(out), self.n - self.pos)
            out += self._order[self.pos:self.pos + take]
            self.pos += take
        return out

    def next_shard(self, need: int, need_max: int, rank: int, world: int) -> list[int]:
        """This rank's `need` fresh indices when every rank draws in the same round.

        Every rank advances the sampler by the same `need_max * world` indices (`need_max`: the
        largest `need` over ranks), and rank r takes from its own block of `need_max`, so the
        samplers stay in step and no two ranks get the same prompt, even when dynamic sampling
        makes ranks top up different numbers of groups. One process: the same as `next(need)`.
        """
        drawn = self.next(need_max * world)
        return drawn[rank * need_max:rank * need_max + need]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._perm()


def select_rollouts(parts: list[tuple[Rollout, list[int]]], pad_id: int) -> Rollout:
    """Concatenate chosen rows of several rollouts, re-padding prompts (left) and responses (right).

    Extra left padding does not change log-probs: positions come from the attention mask.
    """
    if len({id(ro) for ro, _ in parts}) == 1:
        ro, _ = parts[0]
        idx = torch.tensor([i for _, rows in parts for i in rows])
        if idx.numel() == ro.input_ids.shape[0] and torch.equal(idx, torch.arange(idx.numel())):
            return ro
    P = max(ro.prompt_len for ro, _ in parts)
    R = max(ro.input_ids.shape[1] - ro.prompt_len for ro, _ in parts)
    fields: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "response_mask", "logprobs")}
    texts, lengths, trunc = [], [], []
    for ro, rows in parts:
        idx = torch.tensor(rows)
        left, right = P - ro.prompt_len, R - (ro.input_ids.shape[1] - ro.prompt_len)
        for name in fields:
            t = getattr(ro, name)[idx]
            fill = pad_id if name == "input_ids" else 0
            fields[name].append(torch.nn.functional.pad(t, (left, right), value=fill))
        texts += [ro.texts[i] for i in rows]
        lengths.append(ro.response_lengths[idx])
        trunc.append(ro.truncated[idx])
    return Rollout(**{k: torch.cat(v) for k, v in fields.items()}, texts=texts,
                   response_lengths=torch.cat(lengths), truncated=torch.cat(trunc), prompt_len=P)


# --------------------------------------------------------------------------- resume state

def save_resume(folder: Path, fingerprint: str, tr: GRPOTrainer) -> None:
    """Write iteration `tr.it`'s full state to folder/iter_NNNNNN atomically; keep the last N."""
    meta = {"fingerprint": fingerprint, "iteration": tr.it, "total_iters": tr.total_iters,
            "sampler": tr.sampler.state(), "nonfinite_run": tr.nonfinite_run, "skipped": tr.skipped,
            "adaptive_log": tr.adaptive_log, "series": tr.series}
    rng = {"sampling": tr.gen.get_state(), **capture_rng_state()}
    save_training_state(folder / f"iter_{tr.it:06d}", tr.policy, tr.optimizer, None, rng, meta)
    for old in sorted(folder.glob("iter_*"))[: -tr.g.keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _peek_fingerprint(cand: Path) -> str | None:
    try:
        return json.loads((cand / TRAIN_JSON).read_text())["extra"]["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_resume(folder: Path, fingerprint: str, tr: GRPOTrainer) -> int | None:
    """Restore the newest intact state whose fingerprint matches; returns its iteration or None."""
    if not folder.is_dir():
        return None
    for cand in sorted(folder.glob("iter_*"), reverse=True):
        if _peek_fingerprint(cand) != fingerprint:
            print(f"{tr.stage}: ignoring resume state {cand} (other inputs/params, or unreadable)")
            continue
        try:
            state = load_training_state(cand, tr.policy, tr.optimizer)
        except CheckpointError as exc:
            print(f"{tr.stage}: ignoring resume state {cand} ({exc})")
            continue
        rng, meta = state["rng_state"], state["extra"]
        tr.gen.set_state(rng.pop("sampling"))
        restore_rng_state(rng)
        tr.sampler.load(meta["sampler"])
        tr.it, tr.total_iters = meta["iteration"], meta["total_iters"]
        tr.nonfinite_run, tr.skipped = meta["nonfinite_run"], meta["skipped"]
        tr.adaptive_log, tr.series = meta["adaptive_log"], meta["series"]
        print(f"{tr.stage}: resuming from {cand} (iteration {tr.it})")
        return tr.it
    return None
