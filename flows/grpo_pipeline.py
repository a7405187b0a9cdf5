"""The whole pipeline as one Prefect flow: prepare -> sft -> (warmup, control side by side) -> grpo -> evaluate.

Each task runs its DVC stage (``dvc repro --single-item``), so DVC decides what is up to date and a
flow run leaves the same ``dvc.lock``, cache and files as ``dvc repro``. Without overrides the flow
runs in the working directory (the repo root) like ``dvc repro``. With overrides (``--set`` or a
params file other than ``params.yaml``) the run is a DVC experiment named after the flow run: the
stages run in a temporary copy, the result is saved with ``dvc exp save`` (``dvc exp show`` lists
it) and the workspace is left as it was found. The flow holds the workspace lock for the whole
run, opens one MLflow parent run that every stage nests under, and publishes a markdown artifact
per training stage (reward/KL/informative summary, link to its MLflow run) and the evaluation table.

Run it locally, no server needed (Prefect starts a temporary local API)::

    python -m flows.grpo_pipeline                            # params.yaml, in the workspace
    python -m flows.grpo_pipeline --set grpo.kl_coef=0.02    # an experiment

Serve it on a schedule: ``python -m flows.serve`` (see flows/serve.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.experiment import exp_name, experiment_copy, save_experiment
from pipeline.cli import add_config_args, exit_status
from pipeline.config import METRICS_DIR, PLOTS_DIR, Config
from pipeline.errors import InputError
from pipeline.config_loading import load_config
from pipeline.evaluation import training_summary
from pipeline.lock import check_free, workspace_lock
from pipeline.tracking import end_pipeline_run, run_link, run_name, start_pipeline_run
from pipeline.tracking.common import ROOT_ENV
from tasks.stages import STAGE_TASKS, changed_stages

EVAL_ARTIFACT_KEY = "grpo-eval"
TRAINING_STAGES = ("sft", "warmup", "control", "grpo")
SFT_SERIES = ("sft", "control")  # step-indexed series (plots/<stage>.csv with sft.csv's columns)


# --------------------------------------------------------------------------- overrides

def _hydra_value(value: Any) -> str:
    """A value as DVC's ``-S`` (Hydra's override grammar) reads it back unchanged."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def effective_overrides(params_path: str, overrides: Sequence[str] | None) -> list[str]:
    """The overrides a run applies to ``params.yaml``: a params file other than ``params.yaml`` counts
    as setting each value it changes; then ``overrides``. Fails on a bad config before any task."""
    overrides = list(overrides or [])
    extra: list[str] = []
    if Path(params_path).resolve() != Path("params.yaml").resolve():
        base, other = load_config("params.yaml").flat(), load_config(params_path).flat()
        extra = [f"{k}={_hydra_value(v)}" for k, v in other.items() if base.get(k) != v]
    load_config("params.yaml" if not extra else params_path, overrides)
    return extra + overrides


# --------------------------------------------------------------------------- artifacts

def eval_rows(metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``{stage: {metric: value}}`` (metrics/eval.json) -> one table row per evaluated checkpoint."""
    return [{"stage": stage, **values} for stage, values in metrics.items()]


def publish_eval(metrics: dict[str, dict[str, Any]] | None = None, key: str = EVAL_ARTIFACT_KEY,
                 workdir: str | Path = ".") -> list[dict[str, Any]]:
    """Publish the evaluation table (from ``metrics`` or metrics/eval.json) as Prefect artifacts."""
    if metrics is None:
        path = Path(workdir) / METRICS_DIR / "eval.json"
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


def stage_markdown(stage: str, status: str, summary: dict[str, Any], link: str | None) -> str:
    """The training-stage artifact: what DVC did, the summary of its curve, where its MLflow run is."""
    lines = [f"## {stage}", "", f"DVC: **{status}**" + (" (up to date; outputs of an earlier run)" if status != "ran" else "")]
    if summary:
        lines += ["", "| signal | final | mean |", "|---|---|---|"]
        signals = sorted({k.rsplit("_", 1)[0] for k in summary if k.endswith(("_final", "_mean"))})
        lines += [f"| {s} | {summary.get(f'{s}_final', '')} | {summary.get(f'{s}_mean', '')} |" for s in signals]
        lines += ["", f"iterations: {summary.get('iterations')}"]
    if link:
        lines += ["", f"MLflow run: [{link}]({link})" if link.startswith("http") else f"MLflow run: `{link}`"]
    return "\n".join(lines)


def _sft_summary(csv: Path) -> dict[str, Any]:
    import pandas as pd

    if not csv.is_file() or csv.stat().st_size == 0:
        return {}
    df = pd.read_csv(csv)
    out: dict[str, Any] = {"iterations": int(df["step"].max()) if "step" in df and len(df) else 0}
    for col in ("loss", "arith_accuracy", "gsm8k_accuracy"):
        values = pd.to_numeric(df[col], errors="coerce").dropna() if col in df else []
        if len(values):
            out[f"{col}_final"], out[f"{col}_mean"] = round(float(values.iloc[-1]), 4), round(float(values.mean()), 4)
    return out


def publish_stage(cfg: Config, result: dict[str, Any], parent_run_id: str | None) -> None:
    stage, work = result["stage"], Path(result["workdir"])
    csv = work / PLOTS_DIR / f"{stage}.csv"
    summary = _sft_summary(csv) if stage in SFT_SERIES else training_summary(csv)
    link = run_link(cfg, parent_run_id, stage) if result["status"] == "ran" else None
    create_markdown_artifact(stage_markdown(stage, result["status"], summary, link), key=f"grpo-{stage}",
                             description=f"{stage}: training summary")


# --------------------------------------------------------------------------- the flow

def stage_graph(workdir: str | Path = ".") -> dict[str, tuple[str, ...]]:
    """The stages of ``workdir``'s dvc.yaml in file order, each with every stage it depends on (DVC's
    own graph: the stages whose outputs are its deps, transitively). The graph is declared once, in
    dvc.yaml: the default pipeline's warmup and control both start from checkpoints/sft, so they run
    side by side; a recipe's dvc.yaml (recipes/*/) brings its own stages and edges."""
    import networkx as nx
    import yaml
    from dvc.repo import Repo

    work = Path(workdir).resolve()
    order = list((yaml.safe_load((work / "dvc.yaml").read_text()) or {}).get("stages", {}))
    with Repo(Repo.find_root(str(work))) as repo:
        graph = repo.index.graph  # an edge runs from a stage to a stage it depends on
        mine = {st: st.name for st in graph.nodes if Path(st.path).resolve() == work / "dvc.yaml"}
        ups = {mine[st]: {mine[d] for d in nx.descendants(graph, st) if d in mine} for st in mine}
    return {name: tuple(u for u in order if u in ups[name]) for name in order}


def upstream_of(stages: Sequence[str], parallel: bool = True,
                graph: dict[str, tuple[str, ...]] | None = None) -> dict[str, list[str]]:
    """For each stage of the run, the stages it waits for: its nearest upstream stages in the run (those
    not already upstream of another of them) in ``graph`` (default: the working directory's dvc.yaml),
    or with ``parallel=False`` the stage before it (a chain)."""
    if not parallel:
        return {name: list(stages[i - 1:i]) for i, name in enumerate(stages)}
    graph = stage_graph() if graph is None else graph
    out: dict[str, list[str]] = {}
    for name in stages:
        ups = [u for u in graph[name] if u in stages]
        out[name] = [u for u in ups if not any(u in graph[v] for v in ups)]
    return out


def run_chain(stages: Sequence[str], work: Path, cfg: Config, parent: str | None, label: str | None,
              root: Path, parallel: bool = True) -> dict[str, Any]:
    """Every stage task submitted at once, each taking its upstream stages' results (the graph's edges), so
    Prefect starts a stage as soon as those finish: warmup and control run side by side. Results are
    read in pipeline order, each training stage's artifact published as it finishes; when one fails the
    stages already running are let finish (DVC records them) before its error is raised."""
    from prefect.futures import wait

    changed = changed_stages(str(work))
    changed_list = sorted(changed) if changed is not None else None
    futures: dict[str, Any] = {}
    for name, ups in upstream_of(list(stages), parallel, stage_graph(work)).items():
        futures[name] = STAGE_TASKS[name].submit([futures[u] for u in ups], str(work), parent, label, str(root),
                                                 changed_list)
    results: dict[str, Any] = {}
    try:
        for name in stages:
            results[name] = futures[name].result()
            if name in TRAINING_STAGES:
                publish_stage(cfg, results[name], parent)
    except BaseException:
        wait(list(futures.values()))
        raise
    return results


def execute(stages: Sequence[str] | None, params_path: str, overrides: Sequence[str] | None,
            parallel: bool = True) -> dict[str, Any]:
    """The body of every pipeline flow: lock, experiment copy when overridden, parent run, chain.
    ``stages=None``: every stage of the working directory's dvc.yaml."""
    from prefect.runtime import flow_run

    overrides = effective_overrides(params_path, overrides)  # a bad config fails before any task
    root, name = Path.cwd().resolve(), exp_name(flow_run.name or "local")
    stages = list(stage_graph(root)) if stages is None else stages
    with workspace_lock(f"flow run {name}", root):
        cfg = load_config("params.yaml", overrides)
        copy = experiment_copy(root, name, overrides) if overrides else contextlib.nullcontext(root)
        # an experiment's copy is held under the flow's lock too, so the side-by-side branches running in
        # it pass through that lock instead of refusing each other (in the workspace itself: a no-op)
        with copy as work, workspace_lock(f"flow run {name}", work):
            tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
            if overrides:
                tags["grpo.experiment"] = name
            parent = start_pipeline_run(cfg, name=run_name(cfg, None, name), tags=tags)
            try:
                results = run_chain(stages, work, cfg, parent, name if overrides else None, root, parallel)
                if overrides:
                    results["experiment"] = save_experiment(work, name)
                results["metrics"] = publish_eval(workdir=work) if "evaluate" in stages else []
                results["headline"] = headline(work)
            except BaseException:
                end_pipeline_run(cfg, parent, "FAILED")
                raise
            end_pipeline_run(cfg, parent, "FINISHED")
    return results


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None,
                  parallel: bool = True) -> dict[str, Any]:
    """Every stage of the working directory's dvc.yaml through DVC, along its graph (the default's warmup
    and control side by side; ``parallel=False``: one at a time); an experiment when overridden."""
    return execute(None, params_path, overrides, parallel)


def headline(work: Path) -> str:
    """A short table of the headline numbers (metrics/train.json and metrics/eval.json)."""
    from pipeline.summary import headline_table

    return headline_table(work)


@contextlib.contextmanager
def local_api() -> Iterator[None]:
    """Without PREFECT_API_URL, Prefect starts a temporary local API; give it time on a busy machine."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value() or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() >= 120:
        yield
        return
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120}):
        yield


def enter_recipe(folder: str, overrides: Sequence[str]) -> None:
    """Work in a recipe's folder (its dvc.yaml, params.yaml, lock and outputs); its MLflow runs go to the
    repository's database like the default's (``DVC_ROOT``, what DVC sets for every stage)."""
    from dvc.repo import Repo

    work = Path(folder)
    if not (work / "dvc.yaml").is_file() or not (work / "params.yaml").is_file():
        raise InputError(f"--recipe {folder}: expected a folder with dvc.yaml and params.yaml (e.g. recipes/smollm2)")
    if overrides:
        raise InputError(f"--recipe {folder}: --set is not supported for a recipe's flow run; run "
                         f"`dvc exp run -S KEY=VALUE` in {folder} (a DVC experiment of the recipe)")
    os.environ[ROOT_ENV] = Repo.find_root(str(work.resolve()))
    os.chdir(work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.grpo_pipeline", description=__doc__.splitlines()[0])
    add_config_args(p, params_help="params file (another file: an experiment on its values)",
                    set_help="override one param (the run becomes a DVC experiment); repeatable")
    p.add_argument("--sequential", action="store_true",
                   help="one stage at a time (default: warmup and control side by side, each on its own cores)")
    p.add_argument("--recipe", default=None, metavar="DIR",
                   help="run the pipeline of another folder with its own dvc.yaml and params.yaml (recipes/smollm2)")
    args = p.parse_args(argv)

    def run() -> int:
        if args.recipe:
            enter_recipe(args.recipe, args.overrides)
        effective_overrides(args.params, args.overrides)
        check_free()  # one line before Prefect starts, not a failed flow run's traceback
        with local_api():
            results = grpo_pipeline(args.params, args.overrides, not args.sequential)
        if results.get("experiment"):
            print(f"experiment {results['experiment']} saved: dvc exp show; dvc exp apply {results['experiment']}")
        print(results.get("headline", ""))
        return 0

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
