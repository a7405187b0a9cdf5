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

Stopping it: Ctrl-C (SIGINT), SIGTERM (systemd, Docker, Kubernetes, a cancel from the Prefect UI)
or SIGHUP is forwarded to the running stages (``tasks.stages.stop_stages``): they stop and keep their
resume state, no further stage starts, the MLflow parent run ends KILLED, the flow run ends
Cancelled, and the command prints one line saying what to run to resume (exit 128 + the signal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.experiment import check_gsm8k_source, exp_name, experiment_copy, push_experiment, save_experiment
from pipeline.core.cli import add_config_args, exit_status
from pipeline.core.config import METRICS_DIR, PLOTS_DIR, SFT_STAGES, TRAINING_STAGES, Config
from pipeline.core.config_loading import load_config
from pipeline.core.errors import InputError
from pipeline.core.lock import check_free, workspace_lock
from pipeline.rl.evaluation import training_summary
from pipeline.tracking import end_pipeline_run, run_link, run_name, start_pipeline_run
from pipeline.tracking.common import ROOT_ENV, outputs_digest
from tasks.stages import (STAGE_TASKS, STOP_TIMEOUT_S, changed_stages, reset_stop, stop_stages, stopped_by,
                         stopped_stages)

EVAL_ARTIFACT_KEY = "grpo-eval"


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
    summary = _sft_summary(csv) if stage in SFT_STAGES else training_summary(csv)
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
    stages already running are let finish (DVC records them) before its error is raised; on a signal
    they are stopped instead (:func:`settle`)."""
    reset_stop()
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
    except BaseException as exc:
        raise settle(list(futures.values()), exc)
    return results


def interrupt_signal(exc: BaseException) -> int | None:
    """The signal behind an exception: SIGINT for Ctrl-C (KeyboardInterrupt), the signal of Prefect's
    TerminationSignal (SIGTERM; SIGHUP from :func:`stop_on_signals`); None for an error."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return exc.signal if isinstance(exc, TerminationSignal) else None


def settle(futures: list[Any], exc: BaseException) -> BaseException:
    """What the stages still running do when the chain ends early; returns the exception to raise.
    After a failure they are let finish (DVC records them); after a signal, or one that arrives while
    waiting, they are stopped (``stop_stages``: forwarded, a bounded wait) and nothing more starts."""
    from prefect.futures import wait

    if interrupt_signal(exc) is None:
        try:
            wait(futures)
            return exc
        except BaseException as again:
            if interrupt_signal(again) is None:
                raise
            exc = again
    stop_stages(interrupt_signal(exc))
    wait(futures, timeout=STOP_TIMEOUT_S)  # the stopped tasks record Cancelled, the rest NotReady
    return exc


def execute(stages: Sequence[str] | None, params_path: str, overrides: Sequence[str] | None,
            parallel: bool = True, share: str | None = None) -> dict[str, Any] | Any:
    """The body of every pipeline flow: lock, experiment copy when overridden, parent run, chain.
    ``stages=None``: every stage of the working directory's dvc.yaml. ``share``: a git remote the run
    is pushed to as a DVC experiment (a work pool's runs, flows/deploy.py), overridden or not. A signal
    ends the run Cancelled (a State the flow returns), not Crashed: the stages are stopped by then
    (:func:`settle`)."""
    from prefect.states import Cancelled, Failed

    reset_stop()
    try:
        return _execute(stages, params_path, overrides, parallel, share)
    except InputError as exc:  # the user's to act on: the run ends Failed with that line, not a traceback
        return Failed(message=str(exc), data=exc)
    except BaseException as exc:
        sig = interrupt_signal(exc)
        if sig is None:
            raise
        if stopped_by() is None:  # signalled outside the chain: record it, and no stage starts now
            stop_stages(sig)
        return Cancelled(message=interrupted_message(sig))


def interrupted_message(sig: int) -> str:
    stopped = stopped_stages()
    what = f"stopped {', '.join(stopped)} (resume state kept)" if stopped else "no stage was running"
    return f"interrupted by {signal.Signals(sig).name}: {what}"


def _execute(stages: Sequence[str] | None, params_path: str, overrides: Sequence[str] | None,
             parallel: bool, share: str | None = None) -> dict[str, Any]:
    from prefect.runtime import flow_run

    overrides = effective_overrides(params_path, overrides)  # a bad config fails before any task
    root, name = Path.cwd().resolve(), exp_name(flow_run.name or "local")
    stages = list(stage_graph(root)) if stages is None else stages
    with workspace_lock(f"flow run {name}", root):
        cfg = load_config("params.yaml", overrides)
        experiment = bool(overrides) or share is not None
        copy = experiment_copy(root, name, overrides) if experiment else contextlib.nullcontext(root)
        # an experiment's copy is held under the flow's lock too, so the side-by-side branches running in
        # it pass through that lock instead of refusing each other (in the workspace itself: a no-op)
        with copy as work, workspace_lock(f"flow run {name}", work):
            tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
            if experiment:  # saved as DVC experiment `name` (as `dvc exp run` tags its runs)
                tags["grpo.experiment"] = tags["dvc.exp_name"] = name
            parent = start_pipeline_run(cfg, name=run_name(cfg, None, name), tags=tags)
            try:
                results = run_chain(stages, work, cfg, parent, name if experiment else None, root, parallel)
                if experiment:
                    results["experiment"] = save_experiment(work, name)
                if share is not None:
                    results["shared"] = push_experiment(work, name, share)
                results["metrics"] = publish_eval(workdir=work) if "evaluate" in stages else []
                results["headline"] = headline(work)
            except BaseException as exc:
                end_pipeline_run(cfg, parent, "KILLED" if interrupt_signal(exc) else "FAILED")
                raise
            end_pipeline_run(cfg, parent, "FINISHED", reused_outputs(results, work) if parent else None)
    return results


def reused_outputs(results: dict[str, Any], work: Path) -> dict[str, str | None]:
    """{stage: digest of its outputs} for the stages DVC skipped or restored from its run cache: the
    parent run then shows the results of the runs that produced them (pipeline.tracking)."""
    return {name: outputs_digest(name, work) for name, r in results.items()
            if isinstance(r, dict) and r.get("status") in ("skipped", "restored")}


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None,
                  parallel: bool = True, share: str | None = None) -> dict[str, Any]:
    """Every stage of the working directory's dvc.yaml through DVC, along its graph (the default's warmup
    and control side by side; ``parallel=False``: one at a time); an experiment when overridden, and
    pushed to git remote ``share`` with its outputs when given (a work pool's runs)."""
    return execute(None, params_path, overrides, parallel, share)


def where_to_look(cfg: Config, experiment: str | None = None) -> str:
    """What a finished run prints last: the commands that open its runs in MLflow's and Prefect's UIs
    (both on 127.0.0.1), and DVC's view of it."""
    from prefect.settings import PREFECT_API_URL

    from pipeline.tracking.mlflow_client import tracking_uri

    uri = tracking_uri(cfg) if cfg.tracking.enabled else ""
    if not cfg.tracking.enabled:
        mlflow = "tracking is off (tracking.enabled: false): nothing was logged to MLflow"
    elif uri.startswith("sqlite:///"):
        mlflow = (f"mlflow ui --backend-store-uri {shlex.quote(uri)} --host 127.0.0.1 --port 5000  "
                  f"# http://127.0.0.1:5000, experiment {cfg.tracking.experiment!r}")
    else:
        mlflow = f"{uri}  # experiment {cfg.tracking.experiment!r}"
    api = PREFECT_API_URL.value()
    prefect = (f"{api.removesuffix('/api')}  # this run's server" if api else
               "prefect server start --host 127.0.0.1  # http://127.0.0.1:4200: the local database this run used")
    dvc = (f"dvc exp show --drop 'recipes/'  # experiment {experiment}" if experiment
           else "dvc metrics show  # and plots/accuracy.png, plots/training_curves.png")
    return "\n".join(["where to look:", f"  MLflow   {mlflow}", f"  Prefect  {prefect}", f"  DVC      {dvc}"])


def headline(work: Path) -> str:
    """A short table of the headline numbers (metrics/train.json and metrics/eval.json)."""
    from pipeline.core.summary import headline_table

    return headline_table(work)


@contextlib.contextmanager
def local_api() -> Iterator[None]:
    """Without PREFECT_API_URL, Prefect starts a temporary local API: give it time on a busy machine,
    and start it here, out of a Ctrl-C's reach. A terminal's Ctrl-C goes to the whole process group,
    and the temporary server used to die with it: the interrupted flow then retried a dead API for
    minutes and left its run RUNNING. SIGINT is blocked while the server starts (a blocked signal
    stays blocked across exec), so the flow can still report its run Cancelled; Prefect stops the
    server (SIGTERM) when this process exits."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value():
        check_api(PREFECT_API_URL.value())
        yield
        return
    timeout = max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), 120)
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: timeout}):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            SubprocessASGIServer().start(timeout=timeout)  # the instance Prefect's clients then use
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a Ctrl-C meanwhile is delivered now
        yield


def check_api(url: str, timeout: float = 5.0) -> None:
    """One line, exit 2, when PREFECT_API_URL names a server that does not answer (it used to be a
    119-line traceback after Prefect's retries). Any HTTP answer counts: a server that wants a key or
    has no `/health` (Prefect Cloud) is left to Prefect's own messages."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        why = "connection refused" if "refused" in str(exc).lower() else f"no answer within {timeout:g} s" \
            if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
        raise InputError(f"PREFECT_API_URL={url}: no Prefect server answers ({why}); start one with `prefect server "
                         f"start --host 127.0.0.1`, or unset PREFECT_API_URL to run on a temporary local API") from None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Prefect's TerminationSignal in this process for the whole command,
    not only while the flow engine runs (its own handler, inside), so they stop the stages and the
    temporary API is stopped at exit. SIGHUP matters because the stages run in their own process
    groups: a closed terminal no longer reaches them directly."""
    from prefect.exceptions import TerminationSignal

    def handler(signum: int, _frame: Any) -> None:
        raise TerminationSignal(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def run_flow(call, argv: Sequence[str]) -> tuple[Any, int]:
    """Run a pipeline flow (``call`` returns its final state) from its command line: (its result, 0),
    or on a signal one line on stderr (what was stopped; the command that resumes) and (None, 128 +
    the signal), without a traceback."""
    with stop_on_signals():
        try:
            with local_api():
                state = call()
        except BaseException as exc:  # a signal outside the flow body (while Prefect starts or ends it)
            if interrupt_signal(exc) is None:
                raise
            state, sig = None, interrupt_signal(exc)
        else:
            sig = stopped_by() if state.is_cancelled() else None
    if sig is None:
        return state.result(), 0
    why = state.message if state is not None else f"interrupted by {signal.Signals(sig).name}"
    print(f"{why}; run `{shlex.join(['python', *argv])}` again to resume", file=sys.stderr)
    return None, 128 + sig


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
    p.add_argument("--share", default=None, metavar="REMOTE",
                   help="save the run as a DVC experiment and push it to this git remote (dvc exp push)")
    p.add_argument("--recipe", default=None, metavar="DIR",
                   help="run the pipeline of another folder with its own dvc.yaml and params.yaml (recipes/smollm2)")
    args = p.parse_args(argv)

    def run() -> int:
        if args.recipe:
            enter_recipe(args.recipe, args.overrides)
        overrides = effective_overrides(args.params, args.overrides)
        check_gsm8k_source(Path.cwd(), overrides)
        check_free()  # one line before Prefect starts, not a failed flow run's traceback
        results, code = run_flow(lambda: grpo_pipeline(args.params, args.overrides, not args.sequential,
                                                       args.share, return_state=True),
                                 ["-m", "flows.grpo_pipeline", *(sys.argv[1:] if argv is None else argv)])
        if code:
            return code
        if results.get("experiment"):
            name = results["experiment"]  # `dvc exp apply` checks out the recipe's outputs too, which a clone lacks
            print(f"experiment {name} saved: dvc exp show --drop 'recipes/'; to take it into the workspace: "
                  f"dvc exp branch {name} exp-{name} && git checkout exp-{name} && dvc checkout dvc.yaml")
        if results.get("shared"):
            print(f"pushed to {results['shared']}: dvc exp pull {results['shared']} {results['experiment']}")
        print(results.get("headline", ""))
        print(where_to_look(load_config("params.yaml", overrides), results.get("experiment")))
        return 0

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
