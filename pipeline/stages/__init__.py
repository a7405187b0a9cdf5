"""One pure function per stage, `run_<stage>(cfg) -> dict`, called by the CLI, DVC and Prefect.

The returned dict is small and JSON-serialisable: output paths and headline figures.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from pipeline.config import Config

# stage name -> (module, function); imported lazily so `--help` stays fast
_REGISTRY = {
    "prepare": ("pipeline.stages.prepare", "run_prepare"),
    "sft": ("pipeline.stages.sft", "run_sft"),
    "warmup": ("pipeline.stages.train", "run_warmup"),
    "grpo": ("pipeline.stages.train", "run_grpo"),
    "evaluate": ("pipeline.stages.evaluate", "run_evaluate"),
}


def apply_runtime(cfg: Config) -> None:
    """Process-wide settings every stage runs under (the CLI, DVC and Prefect all get them)."""
    if cfg.model.num_threads > 0:
        import torch

        torch.set_num_threads(cfg.model.num_threads)


def stage_function(name: str) -> Callable[[Config], dict[str, Any]]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(_REGISTRY)}")
    module, func = _REGISTRY[name]
    run = getattr(importlib.import_module(module), func)

    @functools.wraps(run)
    def with_runtime(cfg: Config) -> dict[str, Any]:
        apply_runtime(cfg)
        return run(cfg)

    return with_runtime
