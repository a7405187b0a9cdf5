"""Optimiser, learning-rate schedule and seeding helpers shared by the SFT, warmup and GRPO stages.

- `param_groups`: AdamW weight decay only on weight matrices of linear-like layers; none on biases,
  norm gains or embeddings (nanoGPT's rule, made explicit by module type and tied-weight aware).
- `lr_at`: the learning rate at an optimiser step as a pure function of the step, so a resumed run
  gets exactly the LR it would have had.
- `seed_everything`: Python, NumPy (if installed) and torch RNGs from one seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import torch
from torch import nn

# Modules whose parameters are never decayed, whatever their shape.
_NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def _is_no_decay_module(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return isinstance(module, _NO_DECAY_MODULES) or "norm" in name or "embedding" in name


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and undecayed biases/norms/embeddings (frozen params skipped).

    A parameter owned by a norm or embedding module anywhere (e.g. an lm_head tied to the token
    embedding) is not decayed; every other parameter with 2+ dimensions is.
    """
    no_decay_ids: set[int] = set()
    for mod in module.modules():
        if _is_no_decay_module(mod):
            no_decay_ids.update(id(p) for p in mod.parameters(recurse=False))
    decay, no_decay, seen = [], [], set()
    for _, p in module.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in no_decay_ids else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(module: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `param_groups(module, weight_decay)`; the LR is then set each step with `set_lr`."""
    return torch.optim.AdamW(param_groups(module, weight_decay), lr=lr, betas=betas, eps=eps)


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_steps: int = 0,
          schedule: str = "cosine", min_ratio: float = 0.1) -> float:
    """LR for 0-based optimiser step `step`: linear warmup to `peak_lr` over `warmup_steps` steps
    (step 0 gets peak/warmup), then constant or cosine decay reaching `min_ratio * peak_lr` at the
    last step (`total_steps - 1`) and staying there after it."""
    if schedule not in ("cosine", "constant"):
        raise ValueError(f"schedule = {schedule!r}; allowed: cosine, constant")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    span = total_steps - 1 - warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    min_lr = min_ratio * peak_lr
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy (when installed) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds all CUDA devices
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed` (for sampling that must not share global state)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """Global L2 norm of the gradients (for logging; clipping uses torch's clip_grad_norm_)."""
    norms = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0
