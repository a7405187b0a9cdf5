"""The two GRPO stages, one loop (the reference chapter's section 5):

- ``warmup``: GRPO on the arithmetic curriculum, from ``checkpoints/sft``, writes ``checkpoints/warmup``.
- ``grpo``:   GRPO on GSM8K train, from ``checkpoints/warmup``, writes ``checkpoints/grpo``.

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

import contextlib
import dataclasses
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.core import distributed as dist_utils
from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR, PLOTS_DIR, Config, GRPOConfig, WarmupConfig
from pipeline.core.errors import InputError, TrainingDivergedError
from pipeline.core.files import write_series_csv
from pipeline.core.progress import Pace, progress_bar
from pipeline.data.prompts import fewshot_prompt
from pipeline.data.schema import read_rows
from pipeline.model import fast
from pipeline.model.lora import AdaptersOff, add_lora
from pipeline.model.policy import Policy
from pipeline.rewards.verifiers import rewards_by_source
from pipeline.rl.generation import greedy_accuracy
from pipeline.rl.group_sampling import (Groups, Scaffold, Verifier, count_levels, fitting_rows, level_keep, level_rates,
                                     row_levels, sample_groups)
from pipeline.rl.loss import group_advantages, grpo_loss, informative_fraction, loss_units
from pipeline.tracking import Logger, stage_logger
from pipeline.train import fsdp
from pipeline.train.checkpoint import check_architecture, load_policy, save_policy
from pipeline.train.fsdp import FullOptimizerState, Sharded
from pipeline.train.optim import build_optimizer, count_nonfinite, lr_at, set_lr, step_if_finite
from pipeline.train.resume import check_ranks_agree, load_resume, resume_key, save_resume

log = logging.getLogger(__name__)

STAGE_IO = {  # stage -> (init checkpoint, train file, held-out file)
    "warmup": ("sft", "arith_train.jsonl", "arith_eval.jsonl"),
    "grpo": ("warmup", "gsm8k_train.jsonl", "gsm8k_val.jsonl"),
}
REFERENCE = "sft"
CSV_COLUMNS = ["iteration", "reward", "reward_std", "informative", "kl", "clipfrac", "loss", "grad_norm",
               "response_len", "truncated", "entropy", "lr", "dropped_groups", "reward_sampled",
               "informative_sampled", "skipped_steps", "accuracy"]  # no wall-clock figure: the file is git-tracked
# with `fewshot_examples`, over every completion rolled out: the share sampled after the worked examples, and
# the reward and well-formed `<answer>` rate of the bare ones (the prompt evaluation scores) and of the shown ones
FEWSHOT_COLUMNS = ["fewshot_share", "reward_bare", "well_formed_bare", "reward_shown", "well_formed_shown"]


def csv_columns(conf: GRPOConfig) -> list[str]:
    """The columns of the stage's plots CSV."""
    return CSV_COLUMNS + FEWSHOT_COLUMNS if conf.fewshot_examples else CSV_COLUMNS


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
    def of(cls, stage: str) -> StagePaths:
        if stage not in STAGE_IO:
            raise ValueError(f"stage={stage!r}; allowed: {', '.join(STAGE_IO)}")
        init, train, held_out = STAGE_IO[stage]
        ckpt, data = Path(CHECKPOINT_DIR), Path(DATA_DIR)
        return cls(ckpt / init, ckpt / REFERENCE, ckpt / stage, ckpt / f"{stage}.resume",
                   Path(PLOTS_DIR) / f"{stage}.csv", data / train, data / held_out)


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
    rank: int = 0
    world: int = 1
    levels: list[int] | None = None  # each training row's curriculum level, where prompts are drawn by level
    scaffold: Scaffold | None = None  # `fewshot_examples`: the worked examples, at iteration 0
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

def run_grpo(cfg: Config, stage: str, verifier: Verifier | None = None) -> dict[str, Any]:
    """Run the `warmup` or `grpo` stage; `verifier` maps a row's source to its reward function
    (default: the built-in ones, or the user's `<stage>.reward`)."""
    verifier = verifier or rewards_by_source(getattr(cfg, stage).reward, f"{stage}.reward")  # fails fast
    run = setup(cfg, stage)
    conf, is_main = run.conf, run.rank == 0
    key = compatibility_key(run)
    state = resume(run, key) or TrainState(total_iters=conf.iterations)
    with stage_logger(cfg, stage, enabled=is_main) as tracker, progress_bar(enabled=is_main) as bar:
        if is_main:
            tracker.log_params(cfg.flat())
            tracker.set_tags({"stage": stage, "resumed_from": str(state.iteration)})
        task = bar.add_task(stage, total=state.total_iters, completed=state.iteration, info="")
        pace = Pace(state.iteration, state.total_iters)
        while state.iteration < state.total_iters:
            metrics, samples = grpo_iteration(run, state, verifier)
            state.iteration += 1
            it, last = state.iteration, state.iteration == state.total_iters
            # --- evaluate, adapt the curriculum ------------------------------------------------
            if conf.eval_every and (it % conf.eval_every == 0 or last):
                metrics["accuracy"] = greedy_accuracy(run.sampler(), run.eval_rows, conf.rollout_len)
            adapt_curriculum(conf, state, metrics)
            state.series.append({"iteration": it, **{k: metrics.get(k) for k in csv_columns(conf)[1:]}})
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
                    write_series_csv(run.paths.csv, state.series, csv_columns(conf))
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


def grpo_iteration(run: GRPORun, state: TrainState, verifier: Verifier) -> tuple[dict[str, Any], list[dict]]:
    """One iteration: sample groups -> score -> advantages -> old/ref log-probs -> update.
    Returns this iteration's metrics (averaged over ranks) and a few sample completions."""
    conf, G = run.conf, run.conf.group_size
    t_start = time.perf_counter()
    # --- sample prompt groups, G completions each, scored by the verifier ------------------------
    keep, chance = None, {}
    if run.levels is not None:  # warmup.level_sampling = informative
        state.level_counts = state.level_counts or {str(v): [0.0, 0.0] for v in sorted(set(run.levels))}
        keep, chance = level_keep(state.level_counts, run.levels, conf.level_floor)
    scaffold = run.scaffold.at(state.iteration) if run.scaffold else None
    groups = sample_groups(run.sampler(), run.train_rows, (state.prompt_epoch, state.prompt_pos), conf, verifier,
                           run.generator, run.rank, run.world, keep, scaffold)
    state.prompt_epoch, state.prompt_pos = groups.cursor
    if run.levels is not None:
        state.level_counts = count_levels(state.level_counts, run.levels, groups.sampled_idx, groups.sampled)
    ro = groups.rollout
    if not bool(torch.isfinite(ro.logprobs.masked_fill(~ro.response_mask.bool(), 0.0)).all()):
        raise TrainingDivergedError(f"{run.stage}: the policy's logits are not finite at iteration "
                                    f"{state.iteration + 1} (the weights have exploded); stopped before saving. "
                                    f"The last saved state is intact; lower {run.stage}.lr")
    # --- group-relative advantages ----------------------------------------------------------------
    adv = group_advantages(groups.rewards, G, norm=conf.adv_norm)
    # --- old and reference log-probs, without grad (responses start at ro.prompt_len) -------------
    _sync(run.policy)
    t_lp = time.perf_counter()
    old_lp, ref_lp = old_and_ref_logprobs(run, ro.input_ids, ro.attention_mask, ro.prompt_len,
                                          None if groups.off_policy else ro.logprobs)
    _sync(run.policy)
    t_upd = time.perf_counter()
    # --- the update: grpo_epochs passes over minibatches of whole groups --------------------------
    lr = lr_at(state.iteration, state.total_iters, conf.lr, conf.warmup_iters, conf.lr_schedule)
    set_lr(run.optimizer, lr)
    batch = Batch(ro.input_ids, ro.attention_mask, ro.response_mask, adv, old_lp, ref_lp, ro.prompt_len)
    stats = update(run.policy, run.optimizer, conf, batch, state, run.stage)
    if run.sharded:
        run.sharded.stepped()
    _sync(run.policy)
    times = {**groups.times, "logprobs": t_lp, "update": t_upd, "start": t_start, "end": time.perf_counter()}
    metrics = iteration_metrics(run, state, groups, stats, lr, times)
    # the tracker's view of level sampling (not the git-tracked CSV): each level's chance this
    # iteration drew with, and its informative rate after this iteration's groups
    metrics.update({f"level_keep/{v}": c for v, c in chance.items()})
    if run.levels is not None:
        metrics.update({f"level_informative/{v}": r for v, r in level_rates(state.level_counts).items()})
    return metrics, sample_rows(groups, G)


# --------------------------------------------------------------------------- set-up

def setup(cfg: Config, stage: str) -> GRPORun:
    """Inputs checked and read; policy, reference, optimizer and sampling generator at iteration 0
    (benchmarks call this, then `grpo_iteration`, with no logging or saving)."""
    conf: GRPOConfig = getattr(cfg, stage)
    paths = StagePaths.of(stage)
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
    sharded = None
    if world > 1 and conf.parallel == "fsdp":  # before the optimizer, which then holds the shards
        sharded = Sharded(policy)
        if ref is not None:
            fsdp.shard(ref.module)
        if rank == 0:
            log.info("%s: FSDP2 over %d processes, %d blocks each a unit; the sampler holds the whole weights",
                     stage, world, len(fsdp.blocks(policy.module)))
    elif world > 1:  # compile wraps DDP (not the reverse), so model.compile also holds under torchrun
        ddp = dist_utils.wrap_ddp(policy.module)
        policy.runner = torch.compile(ddp) if cfg.model.compile else ddp
    optimizer = build_optimizer(policy.module, conf.lr, conf.weight_decay)
    # sampling draws on the policy's device: a CUDA op cannot take a CPU generator
    generator = torch.Generator(device=policy.device).manual_seed(conf.seed * 1000 + rank)
    scaffold = worked_examples(policy, paths.train, cfg, stage) if conf.fewshot_examples else None
    return GRPORun(cfg, stage, conf, paths, train_rows, eval_rows, policy, ref, optimizer, generator, rank, world,
                   levels, scaffold, sharded)


def worked_examples(policy: Policy, path: Path, cfg: Config, stage: str) -> Scaffold:
    """`<stage>.fewshot_examples`: the first N rows of the training file `path` as worked examples (where
    evaluate's few-shot entries take theirs from) and the prompt of a question after them. A prompt that
    leaves no room for the rollout in the model's context stays bare (logged once); an InputError where
    the examples alone leave none."""
    conf: GRPOConfig = getattr(cfg, stage)
    shots = [(r["question"], r["solution"]) for r in read_rows(path, conf.fewshot_examples)]
    limit = policy.max_len
    budget = None if limit is None else limit - conf.rollout_len
    told = False

    def prompt(question: str) -> str | None:
        nonlocal told
        text = fewshot_prompt(question, shots, policy.tokenizer, cfg.data)
        if budget is None or len(policy.tokenizer.encode(text)) <= budget:
            return text
        if not told:
            log.warning("%s: with %s.fewshot_examples = %d worked examples some prompts leave no room for "
                        "%s.rollout_len = %d tokens in the %d-token context; those stay bare", stage, stage,
                        conf.fewshot_examples, stage, conf.rollout_len, limit)
            told = True
        return None

    alone = len(policy.tokenizer.encode(fewshot_prompt("", shots, policy.tokenizer, cfg.data)))
    if budget is not None and alone > budget:
        raise InputError(f"{stage}.fewshot_examples = {conf.fewshot_examples}: the worked examples of {path} alone "
                         f"take {alone} tokens, more than the {budget} a prompt may have with {stage}.rollout_len = "
                         f"{conf.rollout_len} in model.block_size = {limit}; allowed: fewer examples, a shorter "
                         f"rollout or a longer context")
    return Scaffold(prompt, frozenset(q for q, _ in shots), conf.fewshot_fade, conf.seed, conf.fewshot_mode)


def check_reference(paths: StagePaths, policy: Policy, ref: Policy) -> None:
    """The KL reference must have the policy's architecture and vocabulary (InputError naming both)."""
    check_architecture(policy.model_cfg, ref.model_cfg, f"{paths.init} (the policy)", paths.reference)
    if ref.tokenizer.vocab_size != policy.tokenizer.vocab_size:
        raise InputError(f"{paths.reference} (the KL reference) has a vocabulary of {ref.tokenizer.vocab_size} "
                         f"tokens but {paths.init} (the policy) has {policy.tokenizer.vocab_size}; they must "
                         "come from one prepare and SFT run")


def compatibility_key(run: GRPORun) -> str:
    """The resume key: a resume state from other params, weights or data is ignored."""
    params = {"stage": dataclasses.asdict(run.conf), "model": dataclasses.asdict(run.cfg.model),
              "template": run.cfg.data.prompt_template}
    p = run.paths
    weights = sorted(p.init.glob("*.safetensors")) + sorted(p.reference.glob("*.safetensors"))
    return resume_key(params, [*weights, p.train, p.eval])


# --------------------------------------------------------------------------- log-probs and update

@dataclass
class Batch:
    """The tensors of one update: (N, T) ids and masks, (N,) advantages, (N, T) old/ref log-probs
    (old None: the policy has not moved since sampling), `start` the first response column."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    start: int = 1


def micro_batches(rows: slice, size: int) -> list[slice]:
    """`rows` cut into slices of `size` rows (0: one slice)."""
    size = size or rows.stop - rows.start
    return [slice(s, min(s + size, rows.stop)) for s in range(rows.start, rows.stop, size)]


def own_width(attention_mask: torch.Tensor) -> int:
    """Columns up to the last one any row of `attention_mask` (n, T) attends: a rollout pads every
    row to the batch's longest response, so a micro-batch of shorter rows ends in columns that are
    pads in all of its rows."""
    cols = attention_mask.any(0).nonzero()
    return int(cols[-1]) + 1 if cols.numel() else attention_mask.shape[1]


def micro_logprobs(model: Policy, ids: torch.Tensor, attn: torch.Tensor, temperature: float, start: int,
                   group: int) -> torch.Tensor:
    """`model.token_logprobs` of one micro-batch over its own width (:func:`own_width`), padded back to
    (n, T) with zeros. Causal attention: no kept column reads a dropped one, so the kept columns' log-
    probs and gradients are those of the full-width pass; the dropped columns are pads, 0 there too.
    With a rollout's lengths (a few rows run to `rollout_len`, most stop far sooner) most micro-batches
    are much narrower than the batch."""
    T = ids.shape[1]
    width = max(own_width(attn), min(start + 1, T))
    logp = model.token_logprobs(ids[:, :width], attn[:, :width], temperature, start=start, group_size=group)
    return torch.nn.functional.pad(logp, (0, T - width)) if width < T else logp


def old_and_ref_logprobs(run: GRPORun, ids: torch.Tensor, attn: torch.Tensor, start: int,
                         sampled: torch.Tensor | None = None):
    """(old, ref) per-token log-probs under inference mode, `micro_batch_size` rows per pass;
    either may be None (see `Batch`).

    old: None with one optimizer step per iteration (the policy has not moved since sampling, so
    old = new.detach() exactly; TRL does the same). Otherwise the log-probs the rollout recorded while
    sampling (`sampled`, PPO's behaviour log-probs: the same weights, temperature and full-vocabulary
    distribution as a recomputed pass, to fp32 rounding) where :func:`reuses_sampled_logprobs` says
    they are that, else one more forward pass of the policy under no grad."""
    conf = run.conf
    single_step = conf.grpo_epochs == 1 and conf.minibatch_groups in (0, conf.prompts_per_iter)
    group = math.gcd(conf.micro_batch_size, conf.group_size) if conf.micro_batch_size else conf.group_size
    parts = micro_batches(slice(0, ids.shape[0]), conf.micro_batch_size)

    def passes(model) -> torch.Tensor:
        return torch.cat([micro_logprobs(model, ids[sl], attn[sl], conf.temperature, start, group) for sl in parts])

    # a sharded module's passes reuse its gathered-weight buffers in training: no inference tensors there
    with torch.no_grad() if run.sharded else torch.inference_mode():
        if single_step:
            old = None
        elif sampled is not None and reuses_sampled_logprobs(run.policy):
            old = sampled
        else:
            old = passes(run.policy)
        ref = passes(run.ref) if run.ref else None
    return old, ref


def reuses_sampled_logprobs(policy: Policy) -> bool:
    """Whether the rollout's recorded log-probs stand in for a recomputed old pass (a fast path,
    `pipeline.model.fast`): compute and weights in fp32, where the decode path and the training
    forward agree to ~1e-6 (tests/test_old_logprobs.py). Under bf16 (autocast or bf16 weights) the two
    paths round differently by ~1e-2, enough to move the clipped ratio, so the old pass is recomputed
    with the training forward, as verl and TRL do for their rollout engines."""
    return (fast.enabled() and policy.autocast_dtype is None
            and all(p.dtype == torch.float32 for p in policy.module.parameters()))


def accumulate_gradients(policy: Policy, conf: GRPOConfig, batch: Batch, rows: slice):
    """Forward + backward of the minibatch `rows` in micro-batches of `conf.micro_batch_size` rows.
    Each micro-batch's loss is weighted by its share of the minibatch's normaliser (`loss_units`),
    and, under DDP, each rank's by its share of the global one, so the accumulated gradient is that
    of one pass over the whole minibatch on one process. Returns (loss, statistics), weighted alike.
    A micro-batch whose size divides, or is divided by, G keeps the shared-prompt log-prob path
    (rows in sub-groups of gcd(size, G) still share their prompt)."""
    resp = batch.response_mask[rows]
    total = max(loss_units(resp, conf.loss_agg), 1.0)
    ddp = dist_utils.loss_weight(loss_units(resp, conf.loss_agg))
    group = math.gcd(conf.micro_batch_size, conf.group_size) if conf.micro_batch_size else conf.group_size
    parts = micro_batches(rows, conf.micro_batch_size)
    loss_sum, stats = torch.zeros((), device=policy.device), {}
    for i, sl in enumerate(parts):
        last = i == len(parts) - 1
        # DDP all-reduces once, on the last micro-batch: forward and backward both inside `no_sync`
        # (DDP decides at the forward whether the next backward reduces)
        with contextlib.nullcontext() if last else policy.no_sync():
            new_lp = micro_logprobs(policy, batch.input_ids[sl], batch.attention_mask[sl], conf.temperature,
                                    batch.start, group)
            old = new_lp.detach() if batch.old_logprobs is None else batch.old_logprobs[sl]
            ref = batch.ref_logprobs[sl] if batch.ref_logprobs is not None else None
            loss, st = grpo_loss(new_lp, old, ref, batch.advantages[sl], batch.response_mask[sl], clip=conf.clip,
                                 kl_coef=conf.kl_coef, clip_high=conf.clip_high or None, loss_agg=conf.loss_agg,
                                 importance=conf.importance, max_len=conf.rollout_len)
            w = loss_units(batch.response_mask[sl], conf.loss_agg) / total
            (loss * (w * ddp)).backward()
        loss_sum = loss_sum + loss.detach() * (w * ddp)
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + v * w
    return loss_sum, stats


def update(policy: Policy, optimizer: torch.optim.Optimizer, conf: GRPOConfig, batch: Batch, state: TrainState,
           stage: str) -> dict[str, float]:
    """`grpo_epochs` passes over minibatches of whole groups (each in micro-batches, one optimizer
    step per minibatch); non-finite steps are skipped and counted (pipeline.train.optim). Returns the
    mean of each loss statistic over the steps taken.

    `minibatch_groups` counts groups over all processes: under DDP each of the `world` processes
    puts `minibatch_groups / world` of its own groups into each step, so every process count takes
    the same number of optimizer steps, each over `minibatch_groups` groups."""
    G, n = conf.group_size, batch.input_ids.shape[0]
    mb = (conf.minibatch_groups // dist_utils.world_size() or n // G) * G
    acc: dict[str, list[torch.Tensor]] = {}
    for _ in range(conf.grpo_epochs):
        for s in range(0, n, mb):
            optimizer.zero_grad(set_to_none=True)
            loss, st = accumulate_gradients(policy, conf, batch, slice(s, min(s + mb, n)))
            norm = step_if_finite(optimizer, policy.module.parameters(), conf.grad_clip, loss)
            count_nonfinite(state, norm is not None, conf.max_nonfinite, stage, f"iteration {state.iteration + 1}",
                            Path(CHECKPOINT_DIR) / f"{stage}.resume")
            if norm is not None:
                for k, v in {**st, "loss": loss, "grad_norm": norm}.items():
                    acc.setdefault(k, []).append(v)
    if not acc:
        return {"kl": float("nan"), "clipfrac": float("nan"), "loss": float("nan"), "grad_norm": float("nan")}
    return {k: sum(float(x) for x in v) / len(v) for k, v in acc.items()}  # host syncs here, once per value


def _sync(policy: Policy) -> None:
    """Wait for queued CUDA work, so that the phase timings are the phases' own (no-op on CPU)."""
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)


# --------------------------------------------------------------------------- metrics, curriculum, output

def iteration_metrics(run: GRPORun, state: TrainState, groups: Groups, stats: dict[str, float], lr: float,
                      times: dict[str, float]) -> dict[str, Any]:
    """The iteration's figures, averaged (or summed, then divided) over ranks."""
    G, ro, rewards, sampled = run.conf.group_size, groups.rollout, groups.rewards, groups.sampled
    resp_f = ro.response_mask.float()
    lengths = resp_f.sum(1)
    n_tok = float(lengths.sum().item())
    # entropy estimate: mean negative log-prob of the sampled tokens (unbiased at temperature 1)
    entropy = -(ro.logprobs * resp_f).sum().item() / max(n_tok, 1.0)
    local = {
        "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
        "informative": informative_fraction(rewards, G),
        "response_len": lengths.mean().item(), "truncated": ro.truncated.float().mean().item(),
        "entropy": entropy, **stats,
    }
    metrics = dist_utils.mean_across_ranks(local)
    # every group rolled out this iteration, the dropped ones included: the policy's own reward and
    # informative fraction (with dynamic sampling, `reward`/`informative` describe the kept batch only)
    n_groups = sampled.shape[0]
    r_sum, r_n, inf_n, n_groups, dropped = dist_utils.sum_across_ranks([
        sampled.sum().item(), sampled.numel(), informative_fraction(sampled.view(-1), G) * n_groups, n_groups,
        groups.dropped])
    metrics.update({
        "reward_sampled": r_sum / max(r_n, 1.0), "informative_sampled": inf_n / max(n_groups, 1.0),
        "lr": lr, "dropped_groups": int(dropped), "skipped_steps": state.skipped,
        "tokens_per_s": n_tok * run.world / max(times["end"] - times["start"], 1e-9),
        "time_rollout": times["rollout"], "time_scoring": times["scoring"],
        "time_logprobs": times["update"] - times["logprobs"], "time_update": times["end"] - times["update"],
    })
    if run.conf.fewshot_examples:
        metrics.update(scaffold_metrics(groups))
    return metrics


def scaffold_metrics(groups: Groups) -> dict[str, float | None]:
    """Over every completion rolled out (dynamic sampling's dropped groups included), summed over ranks:
    the share sampled after the worked examples, and the mean reward and well-formed `<answer>` rate of
    the bare and of the shown completions (None where there were none)."""
    shown, rewards, formed = groups.sampled_shown.bool(), groups.sampled, groups.sampled_formed  # (groups, G)
    sums = []
    for part in (~shown, shown):
        sums += [float(part.sum()), float(rewards[part].sum()), float(formed[part].sum())]
    n_bare, r_bare, f_bare, n_shown, r_shown, f_shown = dist_utils.sum_across_ranks(sums)

    def mean(total: float, n: float) -> float | None:
        return total / n if n else None

    return {"fewshot_share": n_shown / max(n_bare + n_shown, 1.0),
            "reward_bare": mean(r_bare, n_bare), "well_formed_bare": mean(f_bare, n_bare),
            "reward_shown": mean(r_shown, n_shown), "well_formed_shown": mean(f_shown, n_shown)}


def sample_rows(groups: Groups, G: int) -> list[dict[str, Any]]:
    """The first completion of the first three groups, for the tracker's samples table."""
    ro, rows = groups.rollout, groups.rows
    return [{"prompt": rows[i // G]["question"][:200], "completion": ro.texts[i],
             "reward": groups.rewards[i].item(), "gold": rows[i // G]["gold"]}
            for i in range(0, min(len(ro.texts), 3 * G), G)]


def adapt_curriculum(conf: GRPOConfig, state: TrainState, metrics: dict[str, Any]) -> None:
    """Adaptive curriculum (warmup only): leave early, or stay longer while groups are uninformative."""
    if not isinstance(conf, WarmupConfig) or not conf.adaptive:
        return
    acc, it = metrics.get("accuracy"), state.iteration
    decision = None
    # not while worked examples are shown: their groups' reward is not the bare prompt's
    if (acc is not None and metrics["reward"] >= conf.exit_reward and acc >= conf.exit_accuracy
            and not metrics.get("fewshot_share")):
        if it < state.total_iters:
            decision = (f"iteration {it}: reward {metrics['reward']:.3f} and accuracy {acc:.3f} "
                        f"passed the thresholds; leaving the warmup early")
            state.total_iters = it
    elif (it == state.total_iters and metrics["informative"] < conf.min_informative
          and state.total_iters < conf.iterations + conf.max_extra_iters):
        state.total_iters += 1
        decision = (f"iteration {it}: informative {metrics['informative']:.2f} < {conf.min_informative}; "
                    f"extending the warmup by one iteration")
    if decision:
        state.adaptive_log.append(decision)
        log.info("warmup: %s", decision)


def progress_info(metrics: dict[str, Any], dynamic_sampling: bool) -> str:
    """The policy's reward and informative fraction over every group rolled out; with dynamic
    sampling also the kept batch's (filtered towards informative groups)."""
    kept = f" (kept {metrics['reward']:.3f} / {metrics['informative']:.2f})" if dynamic_sampling else ""
    acc = f"  acc {metrics['accuracy']:.3f}" if metrics.get("accuracy") is not None else ""
    return (f"reward {metrics['reward_sampled']:.3f}  inf {metrics['informative_sampled']:.2f}{kept}"
            f"  kl {metrics['kl']:.4f}{acc}")


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
        write_series_csv(run.paths.csv, series, csv_columns(run.conf))
        save_policy(run.paths.out, sampler, extra_state={"stage": run.stage, "summary": summary})
        tracker.log_artifact(run.paths.csv)
        shutil.rmtree(run.paths.resume, ignore_errors=True)
    return summary
