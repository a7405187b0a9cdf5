"""The two GRPO stages, one loop (the reference chapter's section 5):

- ``warmup``: GRPO on its task (``warmup.task``, the arithmetic curriculum by default), from
  ``checkpoints/sft``, writes ``checkpoints/warmup``.
- ``grpo``:   GRPO on its task (``grpo.task``, GSM8K by default), from ``checkpoints/warmup``, writes
  ``checkpoints/grpo``.

The task gives the prompts (its train split), the held-out checks (its validation split) and the
reward (:mod:`pipeline.rewards.task_rewards`: the weighted sum of its parts, each part logged as
``reward/<name>``).

The frozen reference policy of both is the SFT checkpoint. ``run_grpo`` is the loop: one
``grpo_iteration`` (sample groups -> score -> advantages -> old/ref log-probs -> update), then
evaluate, adapt the curriculum, log and save. Everything the loop carries between iterations is a
plain :class:`TrainState`; what stays fixed for the stage (policy, reference, optimizer, data) is a
:class:`GRPORun`.

Resume: every ``save_every`` iterations :mod:`pipeline.train.resume` writes the state, policy, optimizer
and RNGs to ``checkpoints/<stage>.resume/``; a re-run after a kill continues from there and ends
bit-identical (CPU) to an uninterrupted run. Whether a stage needs to run at all is DVC's call.

Several processes (``nproc > 1``): the CLI starts the stage under torchrun; prompts are sharded by
rank and rank 0 writes the outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.core import distributed as dist_utils
from pipeline.core.config import (CHECKPOINT_DIR, DATA_DIR, GRPO_STAGES, PLOTS_DIR, Config, GRPOConfig, WarmupConfig,
                                  stage_of)
from pipeline.core.errors import InputError, TrainingDivergedError
from pipeline.core.files import write_series_csv
from pipeline.core.progress import Pace, progress_bar
from pipeline.data.schema import read_rows
from pipeline.model.lora import AdaptersOff, add_lora
from pipeline.model.policy import Policy
from pipeline.data.tasks import task_files, task_template
from pipeline.rewards.task_rewards import TaskRewards, task_rewards
from pipeline.rl.generation import greedy_accuracy
from pipeline.rl.group_sampling import (PromptSource, adapt_curriculum, fitting_rows, row_levels, sample_groups,
                                     worked_examples)
from pipeline.rl.loss import group_advantages
from pipeline.rl.metrics import iteration_metrics, progress_info, sample_rows
from pipeline.rl.rollout import Rollout
from pipeline.rl.update import Batch, old_and_ref_logprobs, update
from pipeline.tracking import Logger, stage_logger
from pipeline.train.checkpoint import check_architecture, load_policy, save_policy
from pipeline.train.fsdp import FullOptimizerState, Sharded, parallelize
from pipeline.train.optim import build_optimizer, count_nonfinite, lr_at, set_lr, step_if_finite
from pipeline.train.resume import check_ranks_agree, load_resume, resume_key, save_resume

log = logging.getLogger(__name__)

CSV_COLUMNS = ["iteration", "reward", "reward_std", "informative", "kl", "clipfrac", "loss", "grad_norm",
               "response_len", "truncated", "entropy", "lr", "dropped_groups", "reward_sampled",
               "informative_sampled", "skipped_steps", "accuracy"]  # no wall-clock figure: the file is git-tracked
# with `fewshot_examples`, over every completion rolled out: the share sampled after the worked examples, and
# the reward and well-formed `<answer>` rate of the bare ones (the prompt evaluation scores) and of the shown ones
FEWSHOT_COLUMNS = ["fewshot_share", "reward_bare", "well_formed_bare", "reward_shown", "well_formed_shown"]


def csv_columns(conf: GRPOConfig, parts: list[str]) -> list[str]:
    """The columns of the stage's plots CSV: each reward part's mean (`reward/<name>`) after the fixed ones."""
    return (CSV_COLUMNS + (FEWSHOT_COLUMNS if conf.fewshot_examples else [])
            + [f"reward/{p}" for p in parts])


@dataclass
class TrainState:
    """What the loop carries from one iteration to the next besides weights, optimizer and RNGs
    (all of it resumable: JSON values only)."""

    total_iters: int  # the adaptive curriculum may move it
    iteration: int = 0  # iterations done
    prompt_epoch: int = 0  # cursor of the seeded prompt order (pipeline.rl.group_sampling)
    prompt_pos: int = 0
    nonfinite_run: int = 0  # skipped (non-finite) steps in a row
    skipped: int = 0  # skipped steps in all
    adaptive_log: list[str] = field(default_factory=list)
    # warmup.level_sampling = informative: per curriculum level, decayed counts [groups, informative]
    level_counts: dict[str, list[float]] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)  # one CSV row per iteration


@dataclass
class StagePaths:
    init: Path
    reference: Path
    out: Path
    resume: Path
    csv: Path
    train: Path
    eval: Path

    @classmethod
    def of(cls, stage: str, task: str) -> StagePaths:
        """The stage's checkpoints and series, and the train and validation files of its `task`."""
        if stage not in GRPO_STAGES:
            raise ValueError(f"stage={stage!r}; allowed: {', '.join(GRPO_STAGES)}")
        row, ckpt, data, files = stage_of(stage), Path(CHECKPOINT_DIR), Path(DATA_DIR), task_files(task)
        return cls(ckpt / row.init, ckpt / row.reference, ckpt / stage, ckpt / f"{stage}.resume",
                   Path(PLOTS_DIR) / f"{stage}.csv", data / files.train, data / files.val)


@dataclass
class GRPORun:
    """What stays fixed for a stage: its config, files, data, policy, reference, optimizer, generator."""

    cfg: Config
    stage: str
    conf: GRPOConfig
    paths: StagePaths
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    policy: Policy
    ref: Policy | AdaptersOff | None  # anything with token_logprobs
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    rewards: TaskRewards | None = None  # the task's checker and weighted reward parts
    rank: int = 0
    world: int = 1
    prompts: PromptSource = field(default_factory=PromptSource)  # levels to draw by, worked examples
    sharded: Sharded | None = None  # `parallel: fsdp` under torchrun: the shards' whole-weight sampler

    def sampler(self) -> Policy:
        """The policy that samples, is scored on held-out rows and is saved: the trained one, or under
        FSDP its whole copy, refreshed from the shards (a collective: every rank calls it at once)."""
        return self.sharded.refresh() if self.sharded else self.policy

    def optimizer_state(self) -> Any:
        """What a resume state saves of the optimizer: itself, or under FSDP its full state gathered to
        rank 0 (a collective)."""
        return FullOptimizerState(self.policy.module, self.optimizer).gather() if self.sharded else self.optimizer


# --------------------------------------------------------------------------- the loop

def run_grpo(cfg: Config, stage: str, rewards: TaskRewards | None = None) -> dict[str, Any]:
    """Run the `warmup` or `grpo` stage on its task; `rewards` replaces the task's own (tests)."""
    run = setup(cfg, stage, rewards)
    conf, is_main, parts = run.conf, run.rank == 0, run.rewards.names
    key = compatibility_key(run)
    state = resume(run, key) or TrainState(total_iters=conf.iterations)
    with stage_logger(cfg, stage, enabled=is_main) as tracker, progress_bar(enabled=is_main) as bar:
        if is_main:
            tracker.log_params(cfg.flat())
            tracker.set_tags({"stage": stage, "resumed_from": str(state.iteration)})
        task = bar.add_task(stage, total=state.total_iters, completed=state.iteration, info="")
        pace = Pace(state.iteration, state.total_iters)
        while state.iteration < state.total_iters:
            metrics, samples = grpo_iteration(run, state)
            state.iteration += 1
            it, last = state.iteration, state.iteration == state.total_iters
            # --- evaluate, adapt the curriculum ------------------------------------------------
            if conf.eval_every and (it % conf.eval_every == 0 or last):
                metrics["accuracy"] = greedy_accuracy(run.sampler(), run.eval_rows, conf.rollout_len,
                                                      run.rewards.checker.correct)
            adapt_curriculum(conf, state, metrics)
            state.series.append({"iteration": it, **{k: metrics.get(k) for k in csv_columns(conf, parts)[1:]}})
            # --- log -----------------------------------------------------------------------------
            info = progress_info(metrics, conf.dynamic_sampling)
            bar.update(task, completed=it, total=state.total_iters, info=info)
            if is_main and (it % conf.log_every == 0 or it == state.total_iters):
                log_iteration(tracker, stage, state, metrics, samples, f"{info}  {pace.text(it)}")
            # --- save ----------------------------------------------------------------------------
            if it % conf.save_every == 0 and it < state.total_iters:
                gens = dist_utils.gather_tensors(run.generator.get_state())  # every rank's, for an exact resume
                sampler, optimizer = run.sampler(), run.optimizer_state()
                if is_main:
                    save_resume(run.paths.resume, it, key, state, sampler, optimizer, run.generator,
                                conf.keep_last, rank_generators=gens)
                    write_series_csv(run.paths.csv, state.series, csv_columns(conf, parts))
        summary = finish(run, state, tracker)
    dist_utils.barrier()
    return summary


def resume(run: GRPORun, key: str) -> TrainState | None:
    """The newest resume state saved under `key`, restored into the run (None: start afresh). Under FSDP
    every rank reads the whole weights into its sampler and the full optimizer state, and shards both."""
    policy, optimizer = ((run.sharded.sampler, FullOptimizerState(run.policy.module, run.optimizer)) if run.sharded
                         else (run.policy, run.optimizer))
    state = load_resume(run.paths.resume, key, TrainState, policy, optimizer, run.generator, run.rank)
    check_ranks_agree(state.iteration if state else None, run.paths.resume, run.stage)
    if state is not None and run.sharded:
        run.sharded.restore()
    return state


def grpo_iteration(run: GRPORun, state: TrainState) -> tuple[dict[str, Any], list[dict]]:
    """One iteration: sample groups -> score -> advantages -> old/ref log-probs -> update.
    Returns this iteration's metrics (averaged over ranks) and a few sample completions."""
    conf, ro_start = run.conf, _clock(run.policy)
    keep, chance, scaffold = run.prompts.draw(state)
    groups = sample_groups(run.sampler(), run.train_rows, (state.prompt_epoch, state.prompt_pos), conf, run.rewards,
                           run.generator, run.rank, run.world, keep, scaffold)
    state.prompt_epoch, state.prompt_pos = groups.cursor
    levels, ro = run.prompts.observe(state, groups, chance), groups.rollout
    check_finite(ro, run.stage, state.iteration)
    adv = group_advantages(groups.rewards, conf.group_size, norm=conf.adv_norm)
    t_lp = _clock(run.policy)  # old and reference log-probs, no grad (responses start at ro.prompt_len)
    old_lp, ref_lp = old_and_ref_logprobs(run.policy, run.ref, conf, ro.input_ids, ro.attention_mask, ro.prompt_len,
                                          None if groups.off_policy else ro.logprobs, bool(run.sharded))
    t_upd = _clock(run.policy)  # grpo_epochs passes over minibatches of whole groups
    lr = lr_at(state.iteration, state.total_iters, conf.lr, conf.warmup_iters, conf.lr_schedule)
    set_lr(run.optimizer, lr)
    batch = Batch(ro.input_ids, ro.attention_mask, ro.response_mask, adv, old_lp, ref_lp, ro.prompt_len)
    stats = update(run.policy, run.optimizer, conf, batch, lambda loss: optimizer_step(run, state, loss))
    if run.sharded:
        run.sharded.stepped()
    times = {**groups.times, "logprobs": t_lp, "update": t_upd, "start": ro_start, "end": _clock(run.policy)}
    metrics = {**iteration_metrics(conf, groups, stats, times, run.world), "lr": lr, "skipped_steps": state.skipped}
    return {**metrics, **levels}, sample_rows(groups, conf.group_size)


def check_finite(ro: Rollout, stage: str, iteration: int) -> None:
    """Stop before the update (and before any save) where the sampled log-probs are not finite."""
    if not bool(torch.isfinite(ro.logprobs.masked_fill(~ro.response_mask.bool(), 0.0)).all()):
        raise TrainingDivergedError(f"{stage}: the policy's logits are not finite at iteration {iteration + 1} "
                                    f"(the weights have exploded); stopped before saving. The last saved state "
                                    f"is intact; lower {stage}.lr")


def optimizer_step(run: GRPORun, state: TrainState, loss: torch.Tensor) -> torch.Tensor | None:
    """The update's step: clip and step where the gradients are finite (their norm), else skip it and
    count it, stopping after `max_nonfinite` in a row (pipeline.train.optim)."""
    conf = run.conf
    norm = step_if_finite(run.optimizer, run.policy.module.parameters(), conf.grad_clip, loss)
    count_nonfinite(state, norm is not None, conf.max_nonfinite, run.stage, f"iteration {state.iteration + 1}",
                    Path(CHECKPOINT_DIR) / f"{run.stage}.resume")
    return norm


def _clock(policy: Policy) -> float:
    """perf_counter after queued CUDA work, so that the phase timings are the phases' own."""
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)
    return time.perf_counter()


# --------------------------------------------------------------------------- set-up

def setup(cfg: Config, stage: str, rewards: TaskRewards | None = None) -> GRPORun:
    """Inputs checked and read; the task's rewards checked on its first row; policy, reference, optimizer
    and sampling generator at iteration 0 (benchmarks call this, then `grpo_iteration`, with no logging
    or saving)."""
    conf: GRPOConfig = getattr(cfg, stage)
    paths = StagePaths.of(stage, conf.task)
    rewards = rewards or task_rewards(cfg, conf.task)  # a user function that does not import fails here
    rank, world = dist_utils.rank(), dist_utils.world_size()
    if conf.nproc > 1 and world == 1:
        raise InputError(f"{stage}.nproc = {conf.nproc} needs {conf.nproc} processes: run the stage through "
                         f"`python -m pipeline {stage}`, which starts them with torchrun")
    if conf.prompts_per_iter % world:
        raise InputError(f"{stage}.prompts_per_iter = {conf.prompts_per_iter} must be divisible by "
                         f"{stage}.nproc = {world} (prompts are sharded by rank)")
    if conf.minibatch_groups % world:
        raise InputError(f"{stage}.minibatch_groups = {conf.minibatch_groups} must be divisible by "
                         f"{stage}.nproc = {world} (each process takes an equal share of a minibatch)")
    for p in (paths.init, paths.reference):
        if not (p / "config.json").is_file():
            raise InputError(f"{p}: checkpoint not found (run the stage that writes it first)")
    train_rows, eval_rows = read_rows(paths.train), read_rows(paths.eval)[: conf.eval_samples]
    if not train_rows:
        raise InputError(f"{paths.train}: no training rows (re-run the 'prepare' stage)")
    rewards.probe(train_rows[0])  # ... and one that raises or returns the wrong length, here
    torch.manual_seed(conf.seed)
    policy = load_policy(paths.init, run=cfg.model)  # the checkpoint's weights; this run's device, dtype, compile, ...
    check_architecture(cfg.model, policy.model_cfg, "the params", paths.init)
    dist_utils.use_device(policy.device)  # NCCL collectives need tensors on the GPU
    train_rows = fitting_rows(train_rows, policy, conf.rollout_len, paths.train, stage)
    levels = (row_levels(train_rows, paths.train, f"{stage}.level_sampling")
              if isinstance(conf, WarmupConfig) and conf.level_sampling == "informative" else None)
    eval_rows = fitting_rows(eval_rows, policy, conf.rollout_len, paths.eval, stage)
    if cfg.model.lora_rank:  # adapters on the init model; the reference is that model, adapters off
        add_lora(policy, cfg.model)
        ref = AdaptersOff(policy) if conf.kl_coef > 0 else None
    else:
        ref = load_policy(paths.reference, policy.device, run=cfg.model).frozen_copy() if conf.kl_coef > 0 else None
        if ref is not None:
            check_reference(paths, policy, ref)
    policy.eval()  # GRPO runs every module without dropout (LoRA's too); eval() does not stop gradients
    sharded = parallelize(policy, ref, conf.parallel, cfg.model.compile, world, stage)  # before the optimizer
    optimizer = build_optimizer(policy.module, conf.lr, conf.weight_decay)
    # sampling draws on the policy's device: a CUDA op cannot take a CPU generator
    generator = torch.Generator(device=policy.device).manual_seed(conf.seed * 1000 + rank)
    scaffold = (worked_examples(policy, paths.train, cfg.data, conf, stage, task_template(cfg, conf.task))
                if conf.fewshot_examples else None)
    prompts = PromptSource(levels, scaffold, conf.level_floor if levels is not None else 0.0)
    return GRPORun(cfg, stage, conf, paths, train_rows, eval_rows, policy, ref, optimizer, generator, rewards, rank,
                   world, prompts, sharded)


def check_reference(paths: StagePaths, policy: Policy, ref: Policy) -> None:
    """The KL reference must have the policy's architecture and vocabulary (InputError naming both)."""
    check_architecture(policy.model_cfg, ref.model_cfg, f"{paths.init} (the policy)", paths.reference)
    if ref.tokenizer.vocab_size != policy.tokenizer.vocab_size:
        raise InputError(f"{paths.reference} (the KL reference) has a vocabulary of {ref.tokenizer.vocab_size} "
                         f"tokens but {paths.init} (the policy) has {policy.tokenizer.vocab_size}; they must "
                         "come from one prepare and SFT run")


def compatibility_key(run: GRPORun) -> str:
    """The resume key: a resume state from other params, weights or data is ignored."""
    task = run.cfg.tasks.get(run.conf.task)
    params = {"stage": dataclasses.asdict(run.conf), "model": dataclasses.asdict(run.cfg.model),
              "template": run.cfg.data.prompt_template, "task": dataclasses.asdict(task) if task else None}
    p = run.paths
    weights = sorted(p.init.glob("*.safetensors")) + sorted(p.reference.glob("*.safetensors"))
    return resume_key(params, [*weights, p.train, p.eval])


# --------------------------------------------------------------------------- curriculum, output

def log_iteration(tracker: Logger, stage: str, state: TrainState, metrics: dict[str, Any],
                  samples: list[dict[str, Any]], info: str) -> None:
    it = state.iteration
    tracker.log_metrics({f"train/{k}": v for k, v in metrics.items() if v is not None}, step=it)
    if samples:  # one table per stage, appended to (MLflow caps the number of table names)
        tracker.log_table([{"iteration": it, **s} for s in samples], f"samples/{stage}.json")
    log.info("%s %d/%d  %s", stage, it, state.total_iters, info)


def finish(run: GRPORun, state: TrainState, tracker: Logger) -> dict[str, Any]:
    """Write the final checkpoint and series (rank 0), drop the resume states; the stage's summary."""
    series = state.series
    accs = [r["accuracy"] for r in series if r.get("accuracy") is not None]
    summary = {
        "checkpoint": str(run.paths.out), "iterations": state.iteration,
        "reward_first": series[0].get("reward") if series else None,
        "reward_last": series[-1].get("reward") if series else None,
        "accuracy_last": accs[-1] if accs else None, "skipped_steps": state.skipped,
        "adaptive": state.adaptive_log,
    }
    sampler = run.sampler()
    if run.rank == 0:
        write_series_csv(run.paths.csv, series, csv_columns(run.conf, run.rewards.names))
        save_policy(run.paths.out, sampler, extra_state={"stage": run.stage, "summary": summary})
        tracker.log_artifact(run.paths.csv)
        shutil.rmtree(run.paths.resume, ignore_errors=True)
    return summary
