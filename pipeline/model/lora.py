"""LoRA adapters for the hf backend (``peft``, an optional extra), and the memory options a GRPO
stage applies to the policy it loads: gradient checkpointing and LoRA.

- :func:`add_lora` wraps the policy's module in a peft model with rank ``model.lora_rank``,
  ``alpha = model.lora_alpha`` and adapters on ``model.lora_targets``; only the adapter weights
  require grad (the optimizer sees nothing else).
- :class:`AdaptersOff` is the GRPO reference under LoRA: the same module with its adapters
  disabled, so the frozen base is not held twice.
- :func:`merged_state_dict` is the export: every adapted linear's weight with ``B A * alpha / r``
  added, under the base model's own parameter names, so the checkpoint is a plain transformers
  folder that ``AutoModelForCausalLM.from_pretrained`` loads (computed beside the model, which
  keeps its adapters: a resume state saved mid-run can continue training them).
- :func:`adapter_state` / :func:`load_adapter_state`: the trainable adapter tensors alone, for
  the resumable training state (the base never changes).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pipeline.core.config import ModelConfig


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("model.lora_rank > 0 needs peft: pip install -e '.[lora]'") from None
    return peft


def is_lora(module: nn.Module) -> bool:
    """Whether `module` is a peft model (LoRA adapters on a base model)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def add_lora(policy, model_cfg: ModelConfig) -> None:
    """Put LoRA adapters on the policy's (hf) module, in place; the base weights are frozen.

    The wrapper takes the module's train/eval mode: peft's new modules start in train mode, and a
    caller that restores "the mode it found" (the rollout) would otherwise switch every dropout of
    an eval-mode GRPO policy on, its reference (adapters off) included. Under `model.compile` the
    runner is a compiled wrapper of the adapted module, as it was of the plain one."""
    if policy.backend != "hf":
        raise ValueError("LoRA needs model.backend hf")
    peft = _peft()
    config = peft.LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0,
                             target_modules=list(model_cfg.lora_targets), bias="none", task_type="CAUSAL_LM")
    try:
        module = peft.get_peft_model(policy.module, config)
    except ValueError as exc:  # e.g. no module matches the targets
        raise ValueError(f"model.lora_targets = {list(model_cfg.lora_targets)}: {exc}") from None
    policy.module = module.to(policy.device).train(policy.module.training)
    policy.runner = torch.compile(policy.module) if policy.model_cfg.compile else policy.module


class AdaptersOff:
    """The base model under a LoRA policy (adapters disabled): a reference without a second copy."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def token_logprobs(self, *args, **kwargs) -> torch.Tensor:
        with self.policy.module.disable_adapter():
            return self.policy.token_logprobs(*args, **kwargs)


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (names as in the base model)."""
    from peft.tuners.lora import LoraLayer

    base = module.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner = next((n for n in layers if key.startswith(n + ".base_layer.")), None)
        if owner is None:
            merged[key] = value
            continue
        name = key[len(owner) + len(".base_layer."):]
        layer = layers[owner]
        if name == "weight":
            value = value + sum(layer.get_delta_weight(a) for a in layer.active_adapters).to(value.dtype)
        merged[f"{owner}.{name}"] = value
    return merged


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors (what training changes under LoRA)."""
    return dict(_peft().get_peft_model_state_dict(module))


def load_adapter_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    result = _peft().set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter state does not match the model (unexpected {unexpected[:3]})")
