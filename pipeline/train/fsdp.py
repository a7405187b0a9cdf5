"""FSDP2 for the GRPO stages (`<stage>.parallel: fsdp` under torchrun): weights, gradients and AdamW's
moments sharded over the ranks, for a model whose training state does not fit one device.

- :func:`shard`: ``fully_shard`` on every transformer block (the GPT's ``h``; a transformers model's
  ``_no_split_modules`` classes), then on the root, which keeps the embeddings, the final norm and the
  head. The forward and backward passes gather one block at a time and reduce-scatter its gradients,
  averaged over the ranks as DDP's are (`pipeline.core.distributed.loss_weight` holds for both).
- :class:`Sharded`: the training module and a whole copy of its weights on every rank, the *sampler*,
  which the rollout, the held-out checks and the checkpoints read. Decoding reads every weight at every
  step (packed MKL weights and the fused decode step hold them for the whole rollout), so it runs on the
  copy, refreshed from the shards (one all-gather) before every rollout: verl's split of a sharded
  trainer and a rollout engine with its own weights, in one process.
- Checkpoints: the model's full state (every rank gathers it, rank 0 writes the usual policy folder)
  and the optimizer's full state keyed by parameter name (gathered to rank 0), so a resume state is a
  plain one; a resumed run reads it on every rank and shards it again, bit for bit.

Memory per rank: the training state / world (weights, gradients, moments: 16 bytes a weight in fp32
over `nproc`), the sampler's weights whole (4 bytes a weight; 2 with `model.param_dtype: bfloat16`),
and one block's weights gathered at a time in the passes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pipeline.core import distributed as dist_utils
from pipeline.model.policy import Policy

log = logging.getLogger(__name__)


def blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of either backend, in order (each becomes its own FSDP unit)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    if not names and hasattr(module, "h"):  # pipeline.model.gpt.GPT
        return list(module.h)
    found = [m for m in module.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"{type(module).__name__}: no transformer blocks found to shard (no _no_split_modules)")
    return found


def shard(module: nn.Module) -> nn.Module:
    """`module` sharded in place over the default process group (see the module docstring)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks(module):
        fully_shard(block)
    fully_shard(module)
    return module


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank (a collective: all ranks call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def load_full_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole weights (the same on every rank) into the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


class FullOptimizerState:
    """What the resume files see of a sharded optimizer: ``state_dict()`` the full state, keyed by
    parameter name (gathered by :meth:`gather` on every rank beforehand, since rank 0 alone writes),
    ``load_state_dict`` shards a full state into the optimizer."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self._gathered: dict[str, Any] | None = None

    def gather(self) -> FullOptimizerState:
        """The full state onto rank 0, in CPU memory (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self._gathered = get_optimizer_state_dict(self.module, self.optimizer,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self

    def state_dict(self) -> dict[str, Any]:
        if self._gathered is None:
            raise RuntimeError("FullOptimizerState.state_dict before gather()")
        return self._gathered

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


class Sharded:
    """A policy trained under FSDP2 and its sampler (see the module docstring). `policy` is whole when
    given, and sharded in place; the sampler is a frozen, whole copy of it."""

    def __init__(self, policy: Policy) -> None:
        self.sampler = policy.frozen_copy()
        self.policy = policy
        shard(policy.module)
        self.fresh = True  # the sampler holds the weights the shards hold

    def refresh(self) -> Policy:
        """The sampler with the shards' current weights (a collective: every rank calls it)."""
        if not self.fresh:
            state = full_state(self.policy.module)
            with torch.no_grad():
                self.sampler.module.load_state_dict(state)
            self.fresh = True
        return self.sampler

    def stepped(self) -> None:
        """The shards moved (an optimizer step): refresh before the next read."""
        self.fresh = False

    def restore(self) -> None:
        """The sampler's weights (a resume state's, read on every rank) into the shards: both hold them."""
        load_full_state(self.policy.module, self.sampler.module.state_dict())
        self.fresh = True


def parallelize(policy: Policy, ref: Any, parallel: str, compile_model: bool, world: int, stage: str) -> Sharded | None:
    """Spread `policy` over the `world` processes of torchrun, before its optimizer is built (which then
    holds the shards): ``parallel: fsdp`` shards it and its KL reference `ref` (the whole weights kept
    in a sampler: the returned :class:`Sharded`); ``ddp`` wraps it in DDP, under ``torch.compile`` when
    `compile_model` (compile wraps DDP, not the reverse). One process: nothing to do (None)."""
    if world <= 1:
        return None
    if parallel == "fsdp":
        sharded = Sharded(policy)
        if ref is not None:
            shard(ref.module)
        if dist_utils.rank() == 0:
            log.info("%s: FSDP2 over %d processes, %d blocks each a unit; the sampler holds the whole weights",
                     stage, world, len(blocks(policy.module)))
        return sharded
    ddp = dist_utils.wrap_ddp(policy.module)
    policy.runner = torch.compile(ddp) if compile_model else ddp
    return None
