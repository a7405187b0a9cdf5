"""Evaluate stage: score each stage's checkpoint on the test split of each task of ``evaluate.tasks``
(default: GSM8K test and the held-out arithmetic set).

For every stage in ``cfg.evaluate.stages`` (checkpoints/<stage>/) and every task, greedy completions
are generated in batches of ``evaluate.batch_size`` prompts (KV-cached ``rollout_prompts``) and scored
with the task's checker and rewards, as in training. With ``evaluate.samples = k > 0``, k seeded samples per problem of
each task in ``evaluate.sample_tasks`` (default: the arithmetic set only) add pass@1 (mean sample
accuracy), pass@k and maj@k (see ``pipeline.rl.evaluation``). Outputs, all written atomically:

- ``metrics/eval.json``: ``{stage: {metric: value}}``, fixed key order, floats to 4 decimals;
- ``reports/predictions_<stage>_<task>.csv``: one row per problem, for error analysis;
- ``plots/accuracy.csv`` (stage, task, accuracy), ``plots/accuracy.png``, ``plots/training_curves.png``.

The same config and checkpoints give byte-identical eval.json and predictions (greedy decoding is
deterministic; sampling uses a generator seeded with ``evaluate.seed`` for each stage and task),
whether the checkpoints are scored one after another or ``evaluate.jobs`` at a time in spawned
processes (on a CPU, by default, as many as the cores allow at ``model.num_threads`` threads each).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.core import files
from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR, METRICS_DIR, PLOTS_DIR, REPORTS_DIR, Config
from pipeline.core.errors import InputError
from pipeline.core.progress import as_text, progress_bar
from pipeline.data.prompts import fewshot_prompt
from pipeline.data.schema import read_rows
from pipeline.data.tasks import task_files, task_template
from pipeline.rewards.task_rewards import TaskRewards, task_rewards
from pipeline.rl import evaluation as ev
from pipeline.rl.generation import generate, row_budgets
from pipeline.tracking import stage_logger

log = logging.getLogger(__name__)

FEWSHOT_SUFFIX = "_fewshot"
TRAINING_CSVS = ("warmup", "grpo")
SAMPLE_TABLE_ROWS = 5  # per stage and task, in the tracker's table of sample predictions


# --------------------------------------------------------------------------- inputs

def load_rows(path: Path, limit: int = 0) -> list[dict[str, Any]]:
    """The first `limit` rows (0 = all) of a prepared JSONL (:func:`pipeline.data.schema.read_rows`), with
    each row's `prompt` and `gold` checked; an empty file is an error (nothing to evaluate)."""
    rows = read_rows(path, limit)  # each with a text prompt and a gold (pipeline.data.schema)
    for row in rows:
        if isinstance(row["gold"], int) and not isinstance(row["gold"], bool):
            row["gold"] = float(row["gold"])  # a number task's gold as a float, as the reports show it
    if not rows:
        raise InputError(f"{path}: no rows to evaluate (re-run the 'prepare' stage)")
    return rows


def entries(e) -> dict[str, tuple[str, bool]]:
    """What evaluate scores, in report order: ``{name: (checkpoint stage, few-shot)}``; each few-shot entry
    (``<stage>_fewshot``) right after its checkpoint's own."""
    out: dict[str, tuple[str, bool]] = {}
    for stage in dict.fromkeys([*e.stages, *e.fewshot_stages]):
        if stage in e.stages:
            out[stage] = (stage, False)
        if stage in e.fewshot_stages:
            out[stage + FEWSHOT_SUFFIX] = (stage, True)
    return out


def load_shots(tasks: Sequence[str], n: int) -> dict[str, list[tuple[str, str]]]:
    """The few-shot examples of each task: (question, worked solution) of the first `n` rows of its
    training file, the same for every question (the test rows never appear among them)."""
    return {task: [(r["question"], r["solution"]) for r in read_rows(Path(DATA_DIR) / task_files(task).train, n)]
            for task in tasks}


def task_limit(e, task: str) -> int:
    """How many test rows of `task` are scored (0: all): `gsm8k_limit`, `arith_limit`, else all."""
    return {"gsm8k": e.gsm8k_limit, "arith": e.arith_limit}.get(task, 0)


def level_metrics(rows: Sequence[dict[str, Any]], preds: Sequence[dict[str, Any]]) -> dict[str, float | int]:
    """Held-out arithmetic accuracy per curriculum level, with its 95% interval and count."""
    out: dict[str, float | int] = {}
    for level in sorted({int(r.get("level", 0)) for r in rows}):
        hits = [bool(p["correct"]) for r, p in zip(rows, preds) if int(r.get("level", 0)) == level]
        low, high = ev.wilson_interval(sum(hits), len(hits))
        out.update({f"arith_level{level}_accuracy": sum(hits) / len(hits), f"arith_level{level}_ci95_low": low,
                    f"arith_level{level}_ci95_high": high, f"arith_level{level}_examples": len(hits)})
    return out


def checkpoint_folder(stage: str) -> Path:
    """checkpoints/<stage>/, verified; an InputError names the folder and the stage that writes it.

    Every checkpoint is checked before any generation, so a bad last one fails in seconds, not
    after the first ones have been evaluated.
    """
    from pipeline.train.manifest import is_checkpoint, verify

    folder = Path(CHECKPOINT_DIR) / stage
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder}/: checkpoint not found; it is written by the '{stage}' stage "
                         f"(run `python -m pipeline {stage}` first, or drop it from evaluate.stages)")
    if is_checkpoint(folder):
        verify(folder)  # CheckpointError (an InputError) on a truncated or corrupt file
    return folder


def evaluate_task(policy, rows: Sequence[dict[str, Any]], cfg: Config,
                  advance: Callable[[int], None] | None = None, samples: int | None = None,
                  rewards: TaskRewards | None = None) -> list[dict[str, Any]]:
    """Per-example prediction rows of one checkpoint on one task (greedy, plus `samples` sampled
    completions per problem; default `evaluate.samples`), scored by the task's `rewards` (default: the
    rows' task's own)."""
    e = cfg.evaluate
    rewards = rewards or task_rewards(cfg, rows[0]["source"])
    prompts = [r["prompt"] for r in rows]
    texts, lengths, truncated = generate(policy, prompts, batch_size=e.batch_size,
                                         max_new_tokens=e.max_new_tokens, advance=advance)
    out = []
    for row, text, length, trunc, scored in zip(rows, texts, lengths, truncated,
                                                ev.score_completions(texts, rows, rewards)):
        out.append({"id": row.get("id", ""), "question": row.get("question", ""), "gold": row["gold"],
                    "completion": text, **scored, "response_length": length, "truncated": trunc})
    k = e.samples if samples is None else samples
    if k > 0:
        generator = torch.Generator(device=policy.device).manual_seed(e.seed)
        sampled, _, _ = generate(policy, prompts, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                                 group_size=k, greedy=False, temperature=e.temperature, top_p=e.top_p,
                                 generator=generator, advance=advance)
        for i, pred in enumerate(out):
            group = sampled[i * k:(i + 1) * k]  # rollouts are group-contiguous
            pred.update(ev.sample_stats(group, rows[i], k, rewards))
    return out


# --------------------------------------------------------------------------- stage

def run_evaluate(cfg: Config) -> dict[str, Any]:
    """Evaluate every configured checkpoint; write metrics, predictions and plots; return paths and metrics."""
    e = cfg.evaluate
    files.recover_outputs("evaluate")  # a publish a kill interrupted is finished first
    data: dict[str, Any] = {"rows": {task: load_rows(Path(DATA_DIR) / task_files(task).test, task_limit(e, task))
                                     for task in e.tasks}}
    for task, rows in data["rows"].items():  # a user reward that does not import, or fails, stops here
        task_rewards(cfg, task).probe(rows[0])
    # every checkpoint checked before any generation
    folders = {name: (checkpoint_folder(stage), fewshot) for name, (stage, fewshot) in entries(e).items()}
    if e.fewshot_stages:
        data["shots"] = load_shots(e.tasks, e.fewshot_examples)
    # the logger opens first: an unreachable tracking server fails in seconds, before generation
    with stage_logger(cfg, "evaluate") as tracker:
        metrics, predictions = _evaluate_all(cfg, data, folders)
        written = _write_outputs(metrics, predictions)
        log.info("%s", as_text(ev.summary_table(metrics, title="Evaluation")))
        tracker.log_metrics({f"eval/{s}/{k}": float(v) for s, m in metrics.items() for k, v in m.items()}, step=0)
        for path in written.values():
            tracker.log_artifact(path)
        tracker.log_table(_sample_table(predictions), name="eval_samples.json")
    return {"paths": {k: str(v) for k, v in written.items()}, "metrics": metrics}


def eval_jobs(cfg: Config, checkpoints: int) -> int:
    """Processes for `checkpoints` checkpoints: `evaluate.jobs`, or with 0 on CPU the cores there are
    for `model.num_threads` threads each (one when torch takes them all), on CUDA 1."""
    if cfg.evaluate.jobs > 0:
        return max(1, min(cfg.evaluate.jobs, checkpoints))
    from pipeline.model.policy import resolve_device

    if resolve_device(cfg.model.device).type != "cpu" or cfg.model.num_threads == 0:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores // cfg.model.num_threads, checkpoints))


def _evaluate_checkpoint(cfg: Config, stage: str, target: tuple[Path, bool], data: dict[str, Any],
                         progress=None) -> tuple[dict[str, float | int], dict[str, list[dict[str, Any]]]]:
    """(raw metrics, {task: prediction rows}) of one checkpoint, with few-shot prompts when `target` says so."""
    from pipeline.train.checkpoint import load_policy

    e = cfg.evaluate
    folder, fewshot = target
    tasks = dict(data["rows"])
    k = {task: e.samples if task in e.sample_tasks else 0 for task in tasks}
    policy = load_policy(folder, run=cfg.model)  # this run's device (`auto`: CUDA if available), dtype, ...
    policy.eval()
    per_task, unscorable = {}, {}
    for task, rows in tasks.items():
        if fewshot:
            rows = [{**r, "prompt": fewshot_prompt(r["question"], data["shots"][task], policy.tokenizer, cfg.data,
                                                   task_template(cfg, task))} for r in rows]
        rows, unscorable[task] = set_aside_unfit(policy, rows, e.max_new_tokens, f"{stage}/{task}")
        tasks[task] = rows
        advance = None
        if progress is not None:
            passes = 1 + (1 if k[task] > 0 else 0)  # greedy, then the sampled groups
            bar = progress.add_task(f"{stage}/{task}", total=len(rows) * passes, info="")
            advance = lambda n, bar=bar: progress.advance(bar, n)  # noqa: E731
        per_task[task] = evaluate_task(policy, rows, cfg, samples=k[task], advance=advance,
                                       rewards=task_rewards(cfg, task))
    metrics = ev.stage_metrics(per_task, k)
    # rows the model's context cannot hold (present only when there are some): counted, not scored
    metrics.update({f"{task}_unscorable": len(ids) for task, ids in unscorable.items() if ids})
    if e.per_level and "arith" in per_task:
        metrics.update(level_metrics(tasks["arith"], per_task["arith"]))
    return metrics, per_task


def set_aside_unfit(policy, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                    what: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(the rows whose prompt leaves room to answer in the model's context, the ids of those it does
    not): the latter are reported by id (one warning) and counted, and the rest is scored."""
    budgets = row_budgets(policy, [policy.tokenizer.encode(r["prompt"]) for r in rows], max_new_tokens)
    unfit = [str(r.get("id", f"#{i + 1}")) for i, (r, b) in enumerate(zip(rows, budgets)) if b < 1]
    if unfit:
        shown = ", ".join(unfit[:10]) + (f" and {len(unfit) - 10} more" if len(unfit) > 10 else "")
        log.warning("evaluate %s: %d of %d rows leave no room to answer in the model's context of %s tokens "
                    "and are not scored (%s_unscorable): %s", what, len(unfit), len(rows), policy.max_len,
                    what.rsplit("/", 1)[-1], shown)
    return [r for r, b in zip(rows, budgets) if b >= 1], unfit


def _worker(cfg: Config, stage: str, folder: tuple[Path, bool], data: dict[str, Any]) -> str:
    """One checkpoint in a worker process; the result goes back as JSON text (plain data only)."""
    if cfg.model.num_threads > 0:  # what the stage's own process runs under (pipeline.stages.apply_runtime)
        torch.set_num_threads(cfg.model.num_threads)
    raw, per_task = _evaluate_checkpoint(cfg, stage, folder, data)
    return json.dumps({"raw": raw, "predictions": per_task})


def _evaluate_all(cfg: Config, data: dict[str, Any], folders: dict[str, tuple[Path, bool]]):
    """(rounded metrics {stage: {metric: value}}, predictions {(stage, task): rows}).

    With several jobs, each checkpoint is scored in its own spawned process; every checkpoint's
    figures are the same as in one process (greedy decoding, and a sampling generator seeded per
    task), so the outputs are byte-identical whatever `evaluate.jobs` is."""
    raw: dict[str, dict[str, float | int]] = {}
    predictions: dict[tuple[str, str], list[dict[str, Any]]] = {}
    jobs = eval_jobs(cfg, len(folders))
    if jobs == 1:
        with progress_bar() as progress:
            for stage, folder in folders.items():
                raw[stage], per_task = _evaluate_checkpoint(cfg, stage, folder, data, progress)
                predictions.update({(stage, task): rows for task, rows in per_task.items()})
        return ev.round_metrics(raw), predictions
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    log.info("evaluate: %d checkpoints, %d at a time (evaluate.jobs)", len(folders), jobs)
    start = time.monotonic()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {stage: pool.submit(_worker, cfg, stage, folder, data) for stage, folder in folders.items()}
        for stage, future in futures.items():  # in `evaluate.stages` order, whichever ends first
            result = json.loads(future.result())
            log.info("evaluate: %s scored (%.0f s since the start)", stage, time.monotonic() - start)
            raw[stage] = result["raw"]
            predictions.update({(stage, task): rows for task, rows in result["predictions"].items()})
    return ev.round_metrics(raw), predictions


def _write_outputs(metrics: dict, predictions: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Path]:
    """Every output written under a staging folder, then moved into place together (files.staged_outputs)."""
    import pandas as pd

    written: dict[str, Path] = {}
    with files.staged_outputs("evaluate") as stage:
        for (stage_name, task), preds in predictions.items():
            path = written[f"predictions_{stage_name}_{task}"] = Path(REPORTS_DIR) / f"predictions_{stage_name}_{task}.csv"
            files.write_csv_atomic(stage(path), pd.DataFrame(preds))
        path = written["accuracy_csv"] = Path(PLOTS_DIR) / "accuracy.csv"
        files.write_csv_atomic(stage(path), ev.accuracy_table(metrics))
        path = written["accuracy_png"] = Path(PLOTS_DIR) / "accuracy.png"
        ev.plot_accuracy(metrics, stage(path))
        path = written["training_curves_png"] = Path(PLOTS_DIR) / "training_curves.png"
        ev.plot_training_curves({s: Path(PLOTS_DIR) / f"{s}.csv" for s in TRAINING_CSVS}, stage(path))
        path = written["train_json"] = Path(METRICS_DIR) / "train.json"  # for `dvc exp show` / `metrics diff`
        files.write_json_atomic(stage(path), {s: ev.training_summary(Path(PLOTS_DIR) / f"{s}.csv") for s in TRAINING_CSVS})
        path = written["eval_json"] = Path(METRICS_DIR) / "eval.json"
        files.write_json_atomic(stage(path), metrics)
    return written


def _sample_table(predictions: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    keys = ("id", "question", "gold", "completion", "parsed", "reward", "correct")
    return [{"stage": stage, "task": task, **{k: p[k] for k in keys}}
            for (stage, task), preds in predictions.items() for p in preds[:SAMPLE_TABLE_ROWS]]
