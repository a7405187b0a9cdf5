"""Optimiser, learning-rate schedule and seeding helpers shared by the SFT, warmup and GRPO stages.

- `param_groups`: AdamW weight decay only on weight matrices of linear-like layers; none on biases,
  norm gains or embeddings (nanoGPT's rule, made explicit by module type and tied-weight aware).
- `build_optimizer`: torch's AdamW over those groups; for bf16 weights :class:`MasterAdamW`, which steps
  fp32 master copies (a bf16 weight rounds a fine-tuning update away) and saves them with its state.
- `lr_at`: the learning rate at an optimiser step as a pure function of the step, so a resumed run
  gets exactly the LR it would have had.
- `seed_everything`: Python, NumPy (if installed) and torch RNGs from one seed.
- `step_if_finite` and `count_nonfinite`: the one non-finite policy of SFT and GRPO. A step whose
  loss or gradient norm is not finite (on any rank) is skipped and counted; `max_nonfinite` skipped
  steps in a row stop the stage with :class:`~pipeline.core.errors.TrainingDivergedError`, leaving the
  last resume state intact. A step that leaves any weight non-finite or beyond WEIGHT_LIMIT stops
  the stage at once, before the weights can be sampled from or saved.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import torch
from torch import nn

from pipeline.core import distributed as dist_utils
from pipeline.core.errors import TrainingDivergedError

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


LOW_PRECISION = (torch.bfloat16, torch.float16)  # weights that get an fp32 master copy


def build_optimizer(module: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `param_groups(module, weight_decay)`; the LR is then set each step with `set_lr`.

    fp32 weights (the default) are stepped in place by torch's AdamW; bf16 weights through
    :class:`MasterAdamW`, whose fp32 masters keep the updates a bf16 weight would round away."""
    groups = param_groups(module, weight_decay)
    if any(p.dtype in LOW_PRECISION for g in groups for p in g["params"]):
        return MasterAdamW(groups, lr=lr, betas=betas, eps=eps)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


class MasterAdamW(torch.optim.AdamW):
    """AdamW for bf16 weights: it steps fp32 master copies and rounds them into the weights.

    Why: a bf16 weight keeps 8 significant bits, so an update under half its spacing (|w| / 512:
    4e-5 at |w| = 0.02) rounds away. At `lr = 1e-6` plain bf16 AdamW moved 2% of the weights in 6
    steps, fp32 all of them. The masters (and the moments, which AdamW keeps in its params' dtype)
    are fp32 and accumulate every update; the weights the forward uses are the masters rounded to
    nearest after each step. Cost: 8 bytes more per trained weight (the master, and fp32 moments).

    Gradients arrive on the weights (clipped there by `step_if_finite`); the step copies them into the
    masters in fp32 and releases the weights' own. The state dict carries the masters (`"master"`), so
    a resumed run continues from the same fp32 values, bit for bit."""

    def __init__(self, groups: list[dict], **defaults) -> None:
        self.weights = [p for g in groups for p in g["params"]]
        masters = [{**g, "params": [p.detach().to(torch.float32, copy=True) for p in g["params"]]} for g in groups]
        super().__init__(masters, **defaults)
        self.masters = [p for g in self.param_groups for p in g["params"]]  # the weights' order

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure (the gradients are on the bf16 weights)")
        for w, m in zip(self.weights, self.masters):
            m.grad = None if w.grad is None else w.grad.to(torch.float32)
            w.grad = None  # the fp32 copy replaces it: no third gradient-sized buffer at the step
        super().step()
        for w, m in zip(self.weights, self.masters):
            w.copy_(m)  # round to nearest
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for w in self.weights:
            if set_to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "master": list(self.masters)}

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's state and the masters; a state without masters (plain bf16 AdamW's, saved before
        this class) starts them from the weights already loaded."""
        state = dict(state_dict)
        saved = state.pop("master", None)
        super().load_state_dict(state)
        source = self.weights if saved is None else saved
        if len(source) != len(self.masters):
            raise ValueError(f"{len(source)} master weights saved, {len(self.masters)} trained")
        with torch.no_grad():
            for w, m, s in zip(self.weights, self.masters, source):
                m.copy_(s)
                w.copy_(m)


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


def step_if_finite(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], grad_clip: float,
                   loss: torch.Tensor) -> torch.Tensor | None:
    """After `loss.backward()`: clip the global gradient norm to `grad_clip` and step, unless the loss
    or the norm is non-finite on any rank; then the gradients are cleared and nothing moves.
    Returns the (pre-clip) gradient norm, or None for a skipped step.

    After the step the weights are checked (:func:`check_weights`): a finite gradient can still
    blow the weights up (`lr=1e9`), and the next rollout would then sample from garbage. That raises
    TrainingDivergedError before anything is saved, so every saved state is one that can continue."""
    params = list(params)
    norm = dist_utils.whole(torch.nn.utils.clip_grad_norm_(params, grad_clip))  # a DTensor over sharded gradients
    finite = bool(torch.isfinite(loss).item()) and bool(torch.isfinite(norm).item())
    if not dist_utils.all_true(finite):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    check_weights(params, optimizer)
    return norm


WEIGHT_LIMIT = 1e5  # |w| of a trained transformer stays in the tens; 1e5 means the update exploded


def check_weights(params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> None:
    """TrainingDivergedError unless every weight is finite and within +-WEIGHT_LIMIT (one host sync)."""
    if not params:
        return
    largest = dist_utils.largest_weight(params)  # over every rank's shard where the weights are sharded (FSDP)
    if math.isfinite(largest) and largest <= WEIGHT_LIMIT:
        return
    lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
    raise TrainingDivergedError(
        f"the update made the weights {'non-finite' if not math.isfinite(largest) else f'explode (|w| = {largest:.3g})'}"
        f"{f' at lr = {lr:g}' if lr is not None else ''}; stopped before saving them. The last saved state is "
        "intact; lower the stage's lr")


def count_nonfinite(state, finite: bool, max_nonfinite: int, stage: str, where: str, resume_dir,
                    max_section: str | None = None) -> None:
    """Count a skipped step in `state.skipped` / `state.nonfinite_run` (reset by a finite one); raise
    TrainingDivergedError at `max_nonfinite` in a row (`max_section`: the params section holding
    `max_nonfinite`, if not the stage's own)."""
    if finite:
        state.nonfinite_run = 0
        return
    state.skipped += 1
    state.nonfinite_run += 1
    if state.nonfinite_run >= max_nonfinite:
        raise TrainingDivergedError(
            f"{stage}: {state.nonfinite_run} consecutive non-finite steps at {where}; stopped. The last good "
            f"checkpoint in {resume_dir} is intact; lower {stage}.lr or raise {max_section or stage}.max_nonfinite")
