"""The whole pipeline as one Prefect flow: prepare -> sft -> warmup -> grpo -> evaluate.

One task run per stage, each calling the same stage function as ``python -m pipeline STAGE`` and
``dvc repro``, in the current working directory (the repo root), so a flow run and ``dvc repro`` with
the same params write the same files in the same places. The flow opens one MLflow parent run; every
stage run nests under it. The evaluation table is published as a Prefect artifact (``grpo-eval``).

Run it locally, no server needed (Prefect starts a temporary local API)::

    python -m flows.grpo_pipeline --params configs/smoke.yaml --set grpo.kl_coef=0.02

Serve it on a schedule: ``python -m flows.serve`` (see flows/serve.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline.config import METRICS_DIR, STAGES, ConfigError, load_config
from pipeline.errors import InputError
from tasks.stages import STAGE_TASKS, close_tracking, open_tracking

EVAL_ARTIFACT_KEY = "grpo-eval"


def eval_rows(metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``{stage: {metric: value}}`` (metrics/eval.json) -> one table row per evaluated checkpoint."""
    return [{"stage": stage, **values} for stage, values in metrics.items()]


def publish_eval(metrics: dict[str, dict[str, Any]] | None = None, key: str = EVAL_ARTIFACT_KEY) -> list[dict[str, Any]]:
    """Publish the evaluation table (from ``metrics`` or metrics/eval.json) as Prefect artifacts."""
    if metrics is None:
        path = Path(METRICS_DIR) / "eval.json"
        metrics = json.loads(path.read_text()) if path.is_file() else {}
    rows = eval_rows(metrics)
    if rows:
        create_table_artifact(rows, key=key, description="Evaluation per checkpoint (metrics/eval.json)")
        cols = list(dict.fromkeys(k for r in rows for k in r))
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        create_markdown_artifact("## GRPO evaluation\n\n" + "\n".join(md), key=f"{key}-summary",
                                 description="Evaluation summary")
    return rows


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run every stage in order under one MLflow parent run; publish the evaluation table."""
    overrides = list(overrides or [])
    load_config(params_path, overrides)  # a bad config fails here, before any task runs
    from prefect.runtime import flow_run

    parent = open_tracking(params_path, overrides, run_name=f"flow-{flow_run.name or 'local'}")
    results: dict[str, Any] = {}
    try:
        for name in STAGES:
            results[name] = STAGE_TASKS[name](params_path, overrides, parent)
    except BaseException:
        if parent:
            close_tracking(params_path, overrides, parent, "FAILED")
        raise
    if parent:
        close_tracking(params_path, overrides, parent, "FINISHED")
    publish_eval(results["evaluate"].get("metrics"))
    return results


@contextlib.contextmanager
def local_api() -> Iterator[None]:
    """Without PREFECT_API_URL, Prefect starts a temporary local API; give it time on a busy machine."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value() or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() >= 120:
        yield
        return
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120}):
        yield


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.grpo_pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one param; repeatable")
    args = p.parse_args(argv)
    try:
        load_config(args.params, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with local_api():
            results = grpo_pipeline(args.params, args.overrides)
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v.get("metrics", "done") if k == "evaluate" else "done" for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
