"""torchrun/DDP helpers. Without torchrun every function is the single-process identity."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _ensure_init() -> None:
    if is_distributed() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)


def rank() -> int:
    _ensure_init()
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    _ensure_init()
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap_ddp(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [int(os.environ["LOCAL_RANK"])] if torch.cuda.is_available() else None
    return DDP(module, device_ids=device_ids)


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def mean_across_ranks(metrics: dict[str, float]) -> dict[str, Any]:
    """Average scalar metrics over ranks (equal shards, so the mean of means is the global mean)."""
    if not dist.is_initialized():
        return dict(metrics)
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    _all_reduce_sum(t)
    t /= dist.get_world_size()
    return {k: t[i].item() for i, k in enumerate(keys)}


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sums over ranks of a few scalars (counts, or totals for an exact global mean)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return [v.item() for v in _all_reduce_sum(t)]


def max_across_ranks(value: int) -> int:
    """The largest `value` over ranks (every rank gets it)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_true(flag: bool) -> bool:
    """True on every rank iff true on all ranks (so all ranks skip a non-finite step together)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([0.0 if flag else 1.0])
    return _all_reduce_sum(t).item() == 0.0


def loss_weight(mask: torch.Tensor, loss_agg: str) -> float:
    """Scale of a rank's loss so that DDP's gradient mean equals the single-process gradient.

    The local loss is normalised by local units (tokens for token-mean, sequences otherwise);
    the global loss by global units. DDP averages over W ranks, so weight = W * local / global.
    """
    if not dist.is_initialized():
        return 1.0
    if loss_agg == "token-mean":
        local = float(mask.sum().item())
    elif loss_agg == "seq-mean-token-mean":
        local = float((mask.sum(1) > 0).sum().item())
    else:
        local = float(mask.shape[0])
    total = _all_reduce_sum(torch.tensor([local], dtype=torch.float64)).item()
    return dist.get_world_size() * local / max(total, 1.0)
