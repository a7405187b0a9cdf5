"""Evaluation-only flow: score existing checkpoints without re-training.

``checkpoints`` names folders under ``checkpoints/`` (``sft``, ``warmup``, ``grpo``), i.e. it overrides
``evaluate.stages``; the stage writes metrics/eval.json, reports/ and plots/ as in the full pipeline
(so run it where the checkpoints are, and note it replaces metrics/eval.json)::

    python -m flows.evaluate --checkpoint grpo --params configs/smoke.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect import flow

from flows.grpo_pipeline import local_api, publish_eval
from pipeline.config import ConfigError, load_config
from pipeline.errors import InputError
from tasks.stages import evaluate


@flow(name="grpo-evaluate", log_prints=True)
def evaluate_checkpoints(checkpoints: list[str] | None = None, params_path: str = "params.yaml",
                         overrides: list[str] | None = None) -> dict[str, Any]:
    """Evaluate the given checkpoints (default: grpo) and publish the table as an artifact."""
    overrides = list(overrides or [])
    if checkpoints:
        overrides.append("evaluate.stages=" + json.dumps(list(checkpoints)))
    load_config(params_path, overrides)  # fail on a bad config before the task runs
    result = evaluate(params_path, overrides)
    publish_eval(result.get("metrics"), key="grpo-eval-only")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", dest="checkpoints", action="append", default=[],
                   help="checkpoint under checkpoints/ to evaluate (repeatable; default: evaluate.stages)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        with local_api():
            result = evaluate_checkpoints(args.checkpoints or None, args.params, args.overrides)
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.get("metrics", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
