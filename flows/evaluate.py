"""Evaluation-only flow: score existing checkpoints without re-training.

``checkpoints`` names folders under ``checkpoints/`` (``sft``, ``control``, ``warmup``, ``grpo``), i.e. it
overrides ``evaluate.stages``; like every overridden run it is a DVC experiment (the workspace is left as it
is, ``dvc exp show`` lists the result). Without checkpoints it runs the evaluate stage through DVC
in the workspace (a no-op when it is up to date)::

    python -m flows.evaluate --checkpoint grpo --params configs/smoke.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect import flow

from flows.grpo_pipeline import effective_overrides, execute, run_flow
from pipeline.core.cli import add_config_args, exit_status


def checkpoint_overrides(checkpoints: list[str] | None, overrides: list[str] | None) -> list[str]:
    """The `--set` overrides with `evaluate.stages` set to the checkpoints (when any are given)."""
    overrides = list(overrides or [])
    if checkpoints:
        overrides.append("evaluate.stages=[" + ",".join(checkpoints) + "]")
    return overrides


@flow(name="grpo-evaluate", log_prints=True)
def evaluate_checkpoints(checkpoints: list[str] | None = None, params_path: str = "params.yaml",
                         overrides: list[str] | None = None) -> dict[str, Any]:
    """Evaluate the given checkpoints (default: grpo) and publish the table as an artifact."""
    return execute(("evaluate",), params_path, checkpoint_overrides(checkpoints, overrides))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", dest="checkpoints", action="append", default=[],
                   help="checkpoint under checkpoints/ to evaluate (repeatable; default: evaluate.stages)")
    add_config_args(p)
    args = p.parse_args(argv)

    def run() -> int:
        # a bad --checkpoint is one line before Prefect starts, like any other bad value
        effective_overrides(args.params, checkpoint_overrides(args.checkpoints, args.overrides))
        result, code = run_flow(lambda: evaluate_checkpoints(args.checkpoints or None, args.params, args.overrides,
                                                             return_state=True),
                                ["-m", "flows.evaluate", *(sys.argv[1:] if argv is None else argv)])
        if code:
            return code
        print(json.dumps(result.get("metrics", [])))
        return 0

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
