"""One pure function per stage, `run_<stage>(cfg) -> dict`, called by the CLI, DVC and Prefect.

The returned dict is small and JSON-serialisable: output paths and headline figures.
"""

from __future__ import annotations

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


def stage_function(name: str) -> Callable[[Config], dict[str, Any]]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(_REGISTRY)}")
    module, func = _REGISTRY[name]
    return getattr(importlib.import_module(module), func)
