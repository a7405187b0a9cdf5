"""torchrun/DDP helpers. Without torchrun every function is the single-process identity.

Collectives take their tensors on the process group's device: NCCL has no CPU backend ("No
backend type associated with device type cpu"), so under NCCL the small metric tensors are made on
this rank's GPU. The trainer binds the device it trains on with :func:`use_device`; unbound, it is
``cuda:LOCAL_RANK`` under NCCL and the CPU under gloo.
"""

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


_device: torch.device | None = None


def use_device(device: torch.device | str | None) -> None:
    """Make collectives take their tensors on `device` (the policy's; None: the group's default)."""
    global _device
    _device = torch.device(device) if device is not None else None


def collective_device() -> torch.device:
    """Where the tensors handed to a collective live (see the module docstring)."""
    if _device is not None:
        return _device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _scalars(values: list[float]) -> torch.Tensor:
    """(len(values),) float64 on the collective device."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device())


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
    t = _scalars([metrics[k] for k in keys])
    _all_reduce_sum(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.cpu().tolist()))


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sums over ranks of a few scalars (counts, or totals for an exact global mean)."""
    return _all_reduce_sum(_scalars(values)).cpu().tolist()


def max_across_ranks(value: int) -> int:
    """The largest `value` over ranks (every rank gets it)."""
    if not dist.is_initialized():
        return value
    t = _scalars([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def max_float_across_ranks(value: float) -> float:
    """The largest `value` over ranks (every rank gets it); nan on any rank gives nan."""
    if not dist.is_initialized():
        return value
    t = _scalars([value, 1.0 if value != value else 0.0])  # the value and whether it is nan: one collective
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    largest, nan = t.cpu().tolist()
    return float("nan") if nan else largest


def all_true(flag: bool) -> bool:
    """True on every rank iff true on all ranks (so all ranks skip a non-finite step together)."""
    if not dist.is_initialized():
        return flag
    t = _scalars([0.0 if flag else 1.0])
    return _all_reduce_sum(t).item() == 0.0


def gather_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` (same shape and dtype on every rank) from every rank, in rank order, on the CPU (e.g. each
    rank's sampling RNG state, for a resume state that rank 0 writes)."""
    if not dist.is_initialized():
        return [t.cpu()]
    local = t.to(collective_device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [p.cpu() for p in parts]


def loss_weight(local: float) -> float:
    """Scale of a rank's loss so that DDP's gradient mean equals the single-process gradient.

    The local loss is normalised by `local` units (`pipeline.rl.loss.loss_units`: tokens for
    token-mean, sequences otherwise); the global loss by the global units. DDP averages over W
    ranks, so weight = W * local / global.
    """
    if not dist.is_initialized():
        return 1.0
    total = _all_reduce_sum(_scalars([local])).item()
    return dist.get_world_size() * local / max(total, 1.0)


def sum_gradients(params: list[torch.nn.Parameter], scalars: list[float]) -> list[float]:
    """Sum every parameter's gradient over ranks, and `scalars` with them, in one collective (a
    missing gradient counts as zeros and is then set). Each rank backpropagates its share of a batch
    whose loss is normalised by the global count, so the sum is the whole batch's gradient. Without
    torchrun: nothing moves, `scalars` come back unchanged."""
    if not dist.is_initialized():
        return list(scalars)
    device = collective_device()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([*(g.reshape(-1).to(device, torch.float32) for g in grads),
                      torch.tensor([float(v) for v in scalars], dtype=torch.float32, device=device)])
    _all_reduce_sum(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        summed = flat[offset: offset + n].view_as(g).to(g.dtype)
        if p.grad is None:
            p.grad = summed.to(p.device)
        else:
            p.grad.copy_(summed)
        offset += n
    return flat[offset:].double().cpu().tolist()


def shard(items: list[Any]) -> list[Any]:
    """This rank's share of `items`: every world-size-th one from its rank (the whole list without
    torchrun); over a list sorted by length, each rank gets about the same amount of work."""
    return items[rank()::world_size()]


def largest_weight(params: list[torch.Tensor]) -> float:
    """The largest |w| over `params`, the same on every rank: of a sharded weight (a DTensor, FSDP2) each
    rank reads its own shard and the max is taken over ranks, so every rank decides alike."""
    from torch.distributed.tensor import DTensor

    local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]
    local = [t for t in local if t.numel()]
    largest = float(torch.stack([t.abs().amax().float() for t in local]).amax()) if local else 0.0
    if any(isinstance(p, DTensor) for p in params):
        return max_float_across_ranks(largest)
    return largest


def whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t` (clip_grad_norm_ returns a DTensor over sharded gradients)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
