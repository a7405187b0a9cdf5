"""sft: supervised warm start on the arithmetic curriculum and GSM8K worked solutions; control: the same
SFT continued from the SFT checkpoint, the equal-compute baseline of the warmup.

The arithmetic worked solutions are the first `sft.arith_examples` rows of `data/arith_train.jsonl`
(0: all of them) among those of level <= `sft.arith_max_level` (0: every level) plus the first
`sft.arith_hard_examples` of the harder levels, the budget of worked examples; the warmup draws its
problems from the whole file.
Each step draws `round(sft.batch_size * sft.arith_fraction)` sequences from the arithmetic stream
and the rest from GSM8K train (each source in seeded, reshuffled epochs). A sequence is
`prompt ids + response ids + eos`, with prompt and response tokenized separately exactly as a rollout
sees them (`pipeline.data.prompts.response_text`); sequences longer than `sft.max_len` are dropped.
The loss is the token-mean cross-entropy over response tokens only (prompt and padding masked).
AdamW (`pipeline.train.optim.param_groups`), linear warmup then cosine decay to 10% of `sft.lr`,
global grad-norm clipping.

Every `sft.eval_every` steps and at the end: validation loss on all of `gsm8k_val` and greedy
accuracy on the first `sft.eval_samples` held-out arithmetic problems (scored with the RLVR
verifier's answer matching). Writes `checkpoints/sft/` (atomic, `save_policy`) and `plots/sft.csv`
(step, loss, val_loss, arith_accuracy); metrics `sft/loss`, `sft/lr`, `sft/val_loss`,
`sft/arith_accuracy` go to the stage logger.

The loop has GRPO's shape and policies: a plain :class:`SFTState`, resumable every
`sft.save_every` steps through :mod:`pipeline.train.resume` (`checkpoints/sft.resume/`; a re-run after a
kill continues bit-identically on CPU), non-finite steps skipped and counted with
`sft.max_nonfinite` in a row stopping the stage, one progress bar and the `pipeline` logger.

control (`run_sft(cfg, "control")`): the weights of `checkpoints/sft/` (and its tokenizer), a fresh
AdamW, and this loop with `sft`'s data, budget and batch settings for `control.steps` steps (LR
`control.lr`, `control.warmup_steps`, `control.eval_every`, `control.seed`): the warmup's
update count or wall time spent on more SFT instead of GRPO. With `model.lora_rank` the control trains
LoRA adapters, as the warmup does. Writes `checkpoints/control/`, `plots/control.csv` (sft.csv's
columns) and resumes from `checkpoints/control.resume/`; metrics are `control/...`.

Skip: when `model.init` is set (a checkpoint folder of this pipeline, or a HF model id/folder with
backend `hf`) the stage does not train: it loads that model on the CPU and saves it unchanged as
`checkpoints/sft/` (so warmup/GRPO start from it and use it as the KL reference), and writes a
header-only `plots/sft.csv`. To fine-tune a pretrained model with GRPO, set `model.init`; SFT of an
`init` model is deliberately not done here.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.core import distributed as dist_utils
from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR, PLOTS_DIR, SFT_STAGES, Config, SFTConfig
from pipeline.core.errors import InputError
from pipeline.core.files import write_series_csv
from pipeline.core.progress import Pace, progress_bar
from pipeline.data.prompts import response_text
from pipeline.data.schema import read_rows
from pipeline.data.sft_batches import (Example, MixedBatches, collate, encode_examples, length_chunks, rank_share,
                                  shared_columns, worked_examples)
from pipeline.data.tokenizer import load_tokenizer
from pipeline.model import fast
from pipeline.model.lora import add_lora
from pipeline.model.policy import Policy, build_policy
from pipeline.rl.generation import greedy_correct
from pipeline.tracking import Logger, stage_logger
from pipeline.train.checkpoint import check_architecture, init_policy, load_policy, save_policy
from pipeline.train.optim import build_optimizer, count_nonfinite, lr_at, seed_everything, set_lr, step_if_finite
from pipeline.train.resume import check_ranks_agree, load_resume, resume_key, save_resume

log = logging.getLogger(__name__)

CSV_COLUMNS = ("step", "loss", "val_loss", "arith_accuracy")
OUT, CSV, RESUME = Path(CHECKPOINT_DIR) / "sft", Path(PLOTS_DIR) / "sft.csv", Path(CHECKPOINT_DIR) / "sft.resume"
EVAL_BATCH = 64  # sequences per validation-loss batch


# --------------------------------------------------------------------------- loss

def response_nll(policy, ids: torch.Tensor, attn: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed NLL of the response tokens, their count); position t predicts ids[:, t] from ids[:, :t].

    Plain: the logits of every position, cross-entropy, the response tokens summed. Fast path
    (`pipeline.model.fast`): the columns the rows share (the template's text before the question)
    run once for the whole batch and every row attends to their keys, and the vocabulary projection
    starts at the first column a response token can follow (`Policy.token_logprobs`); the same sum
    up to float rounding (tests/test_sft.py), at 20-40% less work per step."""
    mask = target[:, 1:].float()  # (B, T-1)
    if not fast.enabled():
        logits = policy.logits(ids, attn)[:, :-1].float()  # (B, T-1, V)
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
        return (nll * mask).sum(), int(mask.sum())
    start = max(1, shared_columns(ids, attn, target))  # at or before every row's first response token
    logp = policy.token_logprobs(ids, attn, 1.0, start=start, group_size=ids.shape[0])  # (B, T); 0 before start
    return -(logp[:, 1:] * mask).sum(), int(mask.sum())


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def validation_loss(policy, examples: Sequence[Example], pad_id: int) -> float | None:
    """Token-mean response NLL over all `examples` (eval mode, no grad)."""
    if not examples:
        return None
    was_training = policy.module.training
    policy.eval()
    total, count = 0.0, 0
    # similar lengths together: less padding; under torchrun each rank scores every world-size-th one
    ordered = dist_utils.shard(sorted(examples, key=lambda e: len(e[0])))
    for s in range(0, len(ordered), EVAL_BATCH):
        nll, n = response_nll(policy, *collate(ordered[s:s + EVAL_BATCH], pad_id, policy.device))
        total, count = total + float(nll), count + n
    policy.train(was_training)
    if dist_utils.world_size() > 1:
        total, count = dist_utils.sum_across_ranks([total, count])
    return total / max(count, 1)


def write_series(path: Path, series: list[dict[str, Any]]) -> Path:
    """sft.csv: one row per logged step (the step is the x axis of `dvc plots`)."""
    return write_series_csv(path, series, CSV_COLUMNS)


def _record(series: list[dict[str, Any]], step: int, values: dict[str, Any]) -> None:
    """Merge `values` into the series row of `step` (steps only grow)."""
    if not series or series[-1]["step"] != step:
        series.append({"step": step})
    series[-1].update(values)


# --------------------------------------------------------------------------- stage

def _copy_init(cfg: Config, out: Path, csv_path: Path) -> dict[str, Any]:
    """`model.init` set: save that model unchanged as the SFT checkpoint (see module docstring)."""
    tok = None
    if cfg.model.backend == "gpt":
        tok_path = Path(DATA_DIR) / "tokenizer.json"
        tok = load_tokenizer(tok_path) if tok_path.is_file() else None
    policy = init_policy(cfg.model, tok, device="cpu")
    save_policy(out, policy, extra_state={"stage": "sft", "skipped": True, "init": cfg.model.init})
    write_series(csv_path, [])
    log.info("sft skipped: model.init = %s saved as %s", cfg.model.init, out)
    return {"checkpoint": str(out), "skipped": True, "init": cfg.model.init, "plots": str(csv_path)}


def _load_tokenizer() -> Any:
    path = Path(DATA_DIR) / "tokenizer.json"
    try:
        return load_tokenizer(path)
    except (FileNotFoundError, ValueError) as exc:
        raise InputError(str(exc)) from None


@dataclass
class SFTState:
    """What the SFT loop carries from one step to the next besides weights, optimizer and RNGs
    (all of it resumable: JSON values only)."""

    step: int = 0  # optimizer steps done (skipped ones included)
    nonfinite_run: int = 0  # skipped (non-finite) steps in a row
    skipped: int = 0  # skipped steps in all
    window: list[float] = field(default_factory=list)  # step losses since the last log
    series: list[dict[str, Any]] = field(default_factory=list)  # one CSV row per logged step
    final: dict[str, float | None] = field(default_factory=lambda: {"val_loss": None, "arith_accuracy": None})
    batches: dict[str, Any] = field(default_factory=dict)  # the batch order's state when saved


@dataclass
class SFTRun:
    """What stays fixed for the stage: data, tokenizer, batch order, policy, optimizer."""

    cfg: Config
    stage: str  # sft or control
    conf: SFTConfig  # the loop's settings: cfg.sft, or for the control cfg.sft with control's schedule
    out: Path  # checkpoints/<stage>
    csv: Path  # plots/<stage>.csv
    resume: Path  # checkpoints/<stage>.resume
    tok: Any
    batches: MixedBatches
    val: list[Example]
    eval_rows: list[dict[str, Any]]
    max_new: int  # generation budget of the held-out accuracy check
    dropped: int  # training sequences dropped for length
    policy: Policy
    optimizer: torch.optim.Optimizer
    rank: int = 0
    world: int = 1


def run_sft(cfg: Config, stage: str = "sft") -> dict[str, Any]:
    """The SFT stage, or the control (see the module docstring): the same loop shape as GRPO's, over SFTState."""
    if stage == "sft" and cfg.model.init:
        result = _copy_init(cfg, OUT, CSV) if dist_utils.rank() == 0 else {}
        dist_utils.barrier()
        return result
    started = time.monotonic()
    run = setup(cfg, stage)
    s, is_main = run.conf, run.rank == 0
    key = compatibility_key(cfg, stage)
    state = load_resume(run.resume, key, SFTState, run.policy, run.optimizer, None)
    check_ranks_agree(state.step if state else None, run.resume, stage)
    state = state or SFTState()
    if state.batches:
        run.batches.load(state.batches)
    with stage_logger(cfg, stage, enabled=is_main) as tracker, progress_bar(enabled=is_main) as bar:
        tracker.log_params({f"{stage}/num_params": run.policy.num_params(), f"{stage}/dropped_long": run.dropped})
        task = bar.add_task(stage, total=s.steps, completed=state.step, info="")
        pace = Pace(state.step, s.steps, unit="step")
        run.policy.train()
        while state.step < s.steps:
            state.step += 1
            step, last = state.step, state.step == s.steps
            # --- one optimizer step on a mixed batch ------------------------------------------------
            lr = lr_at(step - 1, s.steps, s.lr, s.warmup_steps, "cosine")
            set_lr(run.optimizer, lr)
            loss = sft_step(run, state)
            bar.update(task, completed=step, info=f"loss {loss:.3f}")
            # --- log, evaluate, save ----------------------------------------------------------------
            if step % s.log_every == 0 or last:
                log_loss(tracker, run.stage, state, lr, s.steps, is_main, pace.text(step))
            if (s.eval_every and step % s.eval_every == 0) or last:
                evaluate(run, state, tracker)  # every rank: the checks are sharded
                if is_main:
                    write_series(run.csv, state.series)
            if step % s.save_every == 0 and not last and is_main:
                state.batches = run.batches.state()
                save_resume(run.resume, step, key, state, run.policy, run.optimizer, None, s.keep_last)
        if s.steps == 0:  # nothing trained: still report the initial model
            state.final = held_out(run)
            _record(state.series, 0, state.final)
        wall = time.monotonic() - started
        if is_main:
            save_policy(run.out, run.policy,
                        extra_state={"stage": stage, "step": s.steps, "seed": s.seed, **state.final})
            write_series(run.csv, state.series)
            tracker.log_metrics({f"{stage}/wall_s": wall}, step=s.steps)
            tracker.log_artifact(run.csv)
    dist_utils.barrier()  # the checkpoint is written before any rank reports the stage done
    if is_main:
        shutil.rmtree(run.resume, ignore_errors=True)
    return {"checkpoint": str(run.out), "plots": str(run.csv), "steps": s.steps, "num_params": run.policy.num_params(),
            "dropped_long": run.dropped, **state.final, "wall_s": round(wall, 1), "skipped_steps": state.skipped}


def sft_step(run: SFTRun, state: SFTState) -> float:
    """Token-mean response NLL over the whole batch, one forward/backward per run of similar length,
    then a step unless the loss or gradient is non-finite (skipped and counted, pipeline.train.optim).

    Under torchrun every rank draws the same batch (the same seeded order), takes its share
    (:func:`rank_share`, cut by length like the whole batch) and normalises by the whole batch's token
    count; the gradients and the loss
    are then summed over ranks (`pipeline.core.distributed.sum_gradients`), so every rank steps with the
    whole batch's gradient: the single-process update up to the order of float sums (tests/test_sft.py)."""
    s, policy, optimizer = run.conf, run.policy, run.optimizer
    parts = run.batches.next()
    n_tokens = sum(len(ids) - n_prompt for part in parts for ids, n_prompt in part)
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    if run.world == 1:
        chunks = [c for part in parts for c in length_chunks(part)]
    else:
        chunks = length_chunks(rank_share(parts, run.rank, run.world))
    for chunk in chunks:
        nll, _ = response_nll(policy, *collate(chunk, run.tok.pad_id, policy.device))
        chunk_loss = nll / n_tokens
        chunk_loss.backward()
        loss += float(chunk_loss.detach())
    params = [p for p in policy.parameters() if p.requires_grad]
    if run.world > 1:
        (loss,) = dist_utils.sum_gradients(params, [loss])
    norm = step_if_finite(optimizer, params, s.grad_clip, torch.tensor(loss))
    count_nonfinite(state, norm is not None, s.max_nonfinite, run.stage, f"step {state.step}", run.resume,
                    "sft")
    if norm is not None:
        state.window.append(loss)
    return loss


def log_loss(tracker: Logger, stage: str, state: SFTState, lr: float, total: int, is_main: bool = True,
             pace: str = "") -> None:
    mean_loss = sum(state.window) / len(state.window) if state.window else float("nan")
    state.window.clear()
    _record(state.series, state.step, {"loss": mean_loss})
    tracker.log_metrics({f"{stage}/loss": mean_loss, f"{stage}/lr": lr}, step=state.step)
    if is_main:
        log.info("%s step %d/%d loss %.4f lr %.2e  %s", stage, state.step, total, mean_loss, lr, pace)


def held_out(run: SFTRun) -> dict[str, float | None]:
    """Validation loss on gsm8k_val and greedy accuracy on the held-out arithmetic slice."""
    accuracy = None
    if run.eval_rows:  # under torchrun each rank scores every world-size-th problem
        correct = greedy_correct(run.policy, dist_utils.shard(run.eval_rows), run.max_new)
        accuracy = dist_utils.sum_across_ranks([correct])[0] / len(run.eval_rows)
    return {"val_loss": validation_loss(run.policy, run.val, run.tok.pad_id), "arith_accuracy": accuracy}


def evaluate(run: SFTRun, state: SFTState, tracker: Logger) -> None:
    state.final = held_out(run)
    _record(state.series, state.step, state.final)
    tracker.log_metrics({f"{run.stage}/{k}": v for k, v in state.final.items() if v is not None}, step=state.step)
    if run.rank == 0:
        log.info("%s step %d val_loss %s arith_accuracy %s", run.stage, state.step, state.final["val_loss"],
                 state.final["arith_accuracy"])


def stage_config(cfg: Config, stage: str) -> SFTConfig:
    """The loop's settings: `sft`, or for the control `sft` with the control's steps, schedule and seed."""
    if stage not in SFT_STAGES:
        raise ValueError(f"stage={stage!r}; allowed: {', '.join(SFT_STAGES)}")
    if stage == "sft":
        return cfg.sft
    c = cfg.control
    return dataclasses.replace(cfg.sft, steps=c.steps, lr=c.lr, warmup_steps=c.warmup_steps,
                               eval_every=c.eval_every, seed=c.seed, num_threads=0, nproc=c.nproc)


def start_policy(cfg: Config) -> Policy:
    """The control's start: the weights and tokenizer of checkpoints/sft, in this run's dtype and device."""
    if not (OUT / "config.json").is_file():
        raise InputError(f"{OUT}: checkpoint not found; the control continues it, so run the sft stage first "
                         "(`python -m pipeline sft`)")
    policy = load_policy(OUT, run=cfg.model)  # this run's device, dtype, compile, dropout, ...
    check_architecture(cfg.model, policy.model_cfg, "the params", OUT)
    if cfg.model.lora_rank:  # trained like the warmup it is the baseline of: adapters on the SFT model
        add_lora(policy, cfg.model)
    return policy


def setup(cfg: Config, stage: str = "sft") -> SFTRun:
    """Seeded; tokenizer, data, batch order, policy and optimizer at step 0. The control's policy and
    tokenizer are checkpoints/sft's; the SFT's a fresh model over data/tokenizer.json."""
    s, data = stage_config(cfg, stage), Path(DATA_DIR)
    rank, world = dist_utils.rank(), dist_utils.world_size()  # before the model: binds this rank's GPU
    if s.nproc > 1 and world == 1:
        raise InputError(f"{stage}.nproc = {s.nproc} needs {s.nproc} processes: run the stage through "
                         f"`python -m pipeline {stage}`, which starts them with torchrun")
    seed_everything(s.seed)
    start = start_policy(cfg) if stage == "control" else None
    tok = start.tokenizer if start is not None else _load_tokenizer()
    budget = worked_examples(read_rows(data / "arith_train.jsonl"), s)
    arith, dropped_a = encode_examples(tok, budget, s.max_len)
    gsm, dropped_g = encode_examples(tok, read_rows(data / "gsm8k_train.jsonl"), s.max_len)
    val, _ = encode_examples(tok, read_rows(data / "gsm8k_val.jsonl"), cfg.model.block_size)
    eval_rows = read_rows(data / "arith_eval.jsonl")[: s.eval_samples]
    if s.arith_fraction == 0:
        arith = []
    if s.arith_fraction == 1:
        gsm = []
    batches = MixedBatches(arith, gsm, s.batch_size, s.arith_fraction, s.seed)
    max_new = check_budget(tok, eval_rows, cfg.model.block_size)
    policy = start if start is not None else build_policy(cfg.model, tok)
    dist_utils.use_device(policy.device)  # NCCL collectives need tensors on the GPU
    optimizer = build_optimizer(policy.module, s.lr, s.weight_decay)
    ckpt = Path(CHECKPOINT_DIR)
    return SFTRun(cfg, stage, s, ckpt / stage, Path(PLOTS_DIR) / f"{stage}.csv", ckpt / f"{stage}.resume", tok,
                  batches, val, eval_rows, max_new, dropped_a + dropped_g, policy, optimizer, rank, world)


def check_budget(tok, rows: list[dict[str, Any]], block_size: int) -> int:
    """The held-out check's generation budget: room for the longest worked response of `rows` plus
    slack (generation also stops at `</answer>`), within the context left by their longest prompt."""
    prompt = max((len(p) for p in tok.encode_batch([r["prompt"] for r in rows])), default=0)
    resp = max((len(r) for r in tok.encode_batch([response_text(r["solution"]) for r in rows])), default=0)
    return max(1, min(resp + 8, block_size - prompt))


def compatibility_key(cfg: Config, stage: str = "sft") -> str:
    """The resume key: a resume state from other params or data (the control: or SFT weights) is ignored."""
    data = Path(DATA_DIR)
    files = [data / f for f in ("arith_train.jsonl", "gsm8k_train.jsonl", "gsm8k_val.jsonl", "arith_eval.jsonl",
                                "tokenizer.json")]
    if stage == "control":
        files += sorted(OUT.glob("*.safetensors"))
    params = {"sft": dataclasses.asdict(stage_config(cfg, stage)), "model": dataclasses.asdict(cfg.model)}
    return resume_key(params, files)
