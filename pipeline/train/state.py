"""Resumable training state (``save_training_state`` / ``load_training_state``): the policy
files of :mod:`pipeline.train.checkpoint` plus ``training_state.json`` (optimizer param groups, scheduler
state, RNG states, extra; tensors replaced by references) and ``training_state.safetensors`` (the referenced tensors:
AdamW moments, torch RNG bytes, ...). Tuples, non-string dict keys and numpy arrays are tagged in
the JSON so the round trip is exact.

Written atomically and verified on load like every checkpoint folder (see
:mod:`pipeline.train.manifest`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import CheckpointError
from pipeline.model.lora import adapter_state, is_lora, load_adapter_state
from pipeline.model.policy import Policy
from pipeline.train.checkpoint import _load_gpt_weights, _load_hf_policy, _write_policy_files
from pipeline.train.manifest import (ADAPTER, TRAIN_JSON, TRAIN_TENSORS, WEIGHTS, _atomic_folder, _read_json,
                                          _write_manifest, verify)


# --------------------------------------------------------------------------- pickle-free state

def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able structure with tensors/arrays moved into `tensors` and replaced by references."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (tensors, arrays, JSON types only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (if present) CUDA RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (missing parts are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(folder: str | Path, policy: Policy, optimizer: torch.optim.Optimizer | None,
                        scheduler_state: dict | None, rng_state: dict | None, extra: dict | None) -> Path:
    """Everything needed to resume bit-exactly, in one atomically written folder."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    doc = {
        "optimizer": _encode(optimizer.state_dict(), tensors) if optimizer is not None else None,
        "scheduler": _encode(scheduler_state, tensors),
        "rng": _encode(rng_state, tensors),
        "extra": _encode(extra, tensors),
    }
    with _atomic_folder(folder) as tmp:
        _write_policy_files(tmp, policy, None)
        if is_lora(policy.module):  # the merged weights cannot be split again: keep the adapters too
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state(policy.module).items()},
                      tmp / ADAPTER, metadata={"format": "pt"})
        save_file(tensors, tmp / TRAIN_TENSORS, metadata={"format": "pt"})
        (tmp / TRAIN_JSON).write_text(json.dumps(doc))
        _write_manifest(tmp)
    return Path(folder)


def load_training_state(folder: str | Path, policy: Policy,
                        optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore weights into `policy` and state into `optimizer` (in place, so wrappers such as DDP
    stay valid); return ``{"scheduler_state", "rng_state", "extra"}`` (RNG is not applied: call
    :func:`restore_rng_state`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    verify(folder)
    if policy.backend == "gpt":
        _load_gpt_weights(policy.module, folder / WEIGHTS, policy.device)
    elif is_lora(policy.module):  # the base is the stage's init, unchanged: restore the adapters
        try:
            load_adapter_state(policy.module, load_file(folder / ADAPTER, device="cpu"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{folder / ADAPTER}: cannot restore the LoRA adapters ({exc})") from None
    else:
        loaded = _load_hf_policy(folder, "cpu")
        policy.module.load_state_dict(loaded.module.state_dict())
    try:
        tensors = load_file(folder / TRAIN_TENSORS)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / TRAIN_TENSORS}: unreadable safetensors file ({exc})") from None
    doc = _read_json(folder / TRAIN_JSON)
    try:
        state = {k: _decode(doc[k], tensors) for k in ("optimizer", "scheduler", "rng", "extra")}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / TRAIN_JSON}: malformed training state ({exc!r})") from None
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{folder / TRAIN_JSON}: no optimizer state saved")
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{folder / TRAIN_JSON}: optimizer state does not match ({exc})") from None
    return {"scheduler_state": state["scheduler"], "rng_state": state["rng"], "extra": state["extra"]}
