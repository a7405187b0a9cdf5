"""The SFT stage's batches: worked examples encoded as a rollout sees them, mixed from two sources
in seeded epochs, cut into runs of similar length, shared between torchrun's ranks.

A sequence is `prompt ids + response ids + eos`, prompt and response tokenized separately
(`pipeline.data.prompts.response_text`); the loss covers the response tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from pipeline.core.config import SFTConfig
from pipeline.core.errors import InputError
from pipeline.data.prompts import response_text

Example = tuple[list[int], int]  # (prompt + response + eos token ids, number of prompt tokens)


def encode_examples(tok, rows: Sequence[dict[str, Any]], max_len: int) -> tuple[list[Example], int]:
    """(examples, dropped): prompt and response encoded separately, eos appended, > max_len dropped."""
    prompts = tok.encode_batch([r["prompt"] for r in rows])
    responses = tok.encode_batch([response_text(r["solution"]) for r in rows])
    examples = [(p + r + [tok.eos_id], len(p)) for p, r in zip(prompts, responses)]
    kept = [e for e in examples if len(e[0]) <= max_len]
    return kept, len(examples) - len(kept)


def collate(examples: Sequence[Example], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Right-padded (B, T) input_ids, attention_mask and target_mask (1 on response tokens, eos included)."""
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    target = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (seq, n_prompt) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        target[i, n_prompt: len(seq)] = 1
    return ids.to(device), attn.to(device), target.to(device)


def shared_columns(ids: torch.Tensor, attn: torch.Tensor, target: torch.Tensor) -> int:
    """Leading columns that every row of the batch has in common (the same real tokens) and that hold
    no response token: the prompt template's text before the question, in every SFT batch."""
    if ids.shape[0] < 2:
        return 0
    same = (ids == ids[:1]).all(0) & attn.bool().all(0) & ~target.bool().any(0)  # (T,)
    return int(same.long().cumprod(0).sum())


CHUNK_COST = 24  # padded positions one more forward/backward costs, in the split of a batch by length


def length_chunks(examples: Sequence[Example], cost: int = CHUNK_COST) -> list[list[Example]]:
    """`examples` sorted by length and cut into runs of similar length, each padded only to its own
    longest: the cut that minimises padded positions plus `cost` per run (an exact dynamic program
    over the sorted lengths). The loss is a sum over tokens, so the runs give the batch's gradient
    (summed in another order); arithmetic solutions vary 2x in length, so one padded block wastes a
    third of its positions."""
    ordered = sorted(examples, key=lambda e: len(e[0]))
    n = len(ordered)
    lengths = [len(e[0]) for e in ordered]
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest cut of the first j examples
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last run is ordered[i:j], padded to lengths[j - 1]
            c = best[i] + (j - i) * lengths[j - 1] + cost
            if c < best[j]:
                best[j], cut[j] = c, i
    runs, j = [], n
    while j:
        runs.append(ordered[cut[j]:j])
        j = cut[j]
    return runs[::-1]


class MixedBatches:
    """Seeded batches mixing two sources in a fixed ratio; each source is read in reshuffled epochs."""

    def __init__(self, arith: list[Example], gsm: list[Example], batch_size: int, arith_fraction: float,
                 seed: int) -> None:
        n_arith = round(batch_size * arith_fraction)
        if not arith:
            n_arith = 0
        elif not gsm:
            n_arith = batch_size
        if not arith and not gsm:
            raise InputError("sft: no training sequences left (all longer than sft.max_len?)")
        self.parts = [(arith, n_arith), (gsm, batch_size - n_arith)]
        self.rng = random.Random(f"sft-batches-{seed}")
        self.orders: list[list[int]] = [[], []]

    def _take(self, k: int, n: int) -> list[Example]:
        source, order = self.parts[k][0], self.orders[k]
        out = []
        while len(out) < n:
            if not order:
                order.extend(range(len(source)))
                self.rng.shuffle(order)
            out.append(source[order.pop()])
        return out

    def state(self) -> dict[str, Any]:
        """The batch order's whole state (JSON values): the RNG and what is left of each epoch."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "orders": [list(o) for o in self.orders]}

    def load(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.orders = [list(o) for o in state["orders"]]

    def next(self) -> list[list[Example]]:
        """One batch as its non-empty per-source parts (padded separately: arithmetic is short)."""
        return [part for k, (_, n) in enumerate(self.parts) if (part := self._take(k, n))]


def rank_share(parts: Sequence[Sequence[Example]], rank: int, world: int) -> list[Example]:
    """This rank's examples of a batch (all its sources' parts): longest first, each to the rank with
    the fewest tokens so far (ties: the lower rank), so the ranks' token counts differ by at most one
    example's length and none waits long for the others at the gradient sum."""
    items = [e for part in parts for e in part]
    order = sorted(range(len(items)), key=lambda i: (-len(items[i][0]), i))
    loads, mine = [0] * world, []
    for i in order:
        r = min(range(world), key=lambda k: (loads[k], k))
        loads[r] += len(items[i][0])
        if r == rank:
            mine.append(items[i])
    return mine


def worked_examples(rows: list[dict[str, Any]], s: SFTConfig) -> list[dict[str, Any]]:
    """The worked-example budget, in stream order: the rows of level <= `sft.arith_max_level` (0: all) and the
    first `sft.arith_hard_examples` rows of the harder levels; then the first `sft.arith_examples` (0: all)."""
    if s.arith_max_level:
        kept, hard = [], 0
        for r in rows:
            if r["level"] > s.arith_max_level:
                if hard == s.arith_hard_examples:
                    continue
                hard += 1
            kept.append(r)
        rows = kept
    return rows[: s.arith_examples or None]
