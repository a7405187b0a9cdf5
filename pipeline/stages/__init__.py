"""One function per stage, `run_<stage>(cfg) -> dict`, called by the CLI (which DVC runs).

The returned dict is small and JSON-serialisable: output paths and headline figures. The stages are
:data:`pipeline.core.config.STAGE_TABLE`; each kind of stage has one function here, which a stage of
the sft and grpo kinds takes its name to (``run_sft(cfg, "control")``, ``run_grpo(cfg, "warmup")``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from pipeline.core.config import STAGE_TABLE, Config

# stage kind -> (module, function); imported lazily so `--help` stays fast
_FUNCTIONS: dict[str, tuple[str, str]] = {
    "prepare": ("pipeline.stages.prepare", "run_prepare"),
    "sft": ("pipeline.stages.sft", "run_sft"),
    "grpo": ("pipeline.stages.grpo", "run_grpo"),
    "evaluate": ("pipeline.stages.evaluate", "run_evaluate"),
}
# stage name -> (module, function, leading arguments after cfg)
_REGISTRY: dict[str, tuple[str, str, tuple[Any, ...]]] = {
    s.name: (*_FUNCTIONS[s.kind], (s.name,) if s.trains else ()) for s in STAGE_TABLE}


def stage_threads(cfg: Config, stage: str) -> int:
    """torch CPU threads of `stage` (0: torch's default): `sft.num_threads` for the sft stage where set,
    else `model.num_threads`."""
    if stage == "sft" and cfg.sft.num_threads > 0:
        return cfg.sft.num_threads
    return cfg.model.num_threads


def apply_runtime(cfg: Config, stage: str) -> None:
    """Process-wide settings `stage` runs under."""
    threads = stage_threads(cfg, stage)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def stage_function(name: str) -> Callable[[Config], dict[str, Any]]:
    """The stage function, run under the workspace lock with the process-wide runtime applied."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(_REGISTRY)}")
    module, func, args = _REGISTRY[name]
    run = getattr(importlib.import_module(module), func)

    @functools.wraps(run)
    def with_runtime(cfg: Config) -> dict[str, Any]:
        from pipeline.core.lock import workspace_lock

        with workspace_lock(f"stage {name}"):  # one run per workspace, whoever started it
            apply_runtime(cfg, name)
            return run(cfg, *args)

    return with_runtime
