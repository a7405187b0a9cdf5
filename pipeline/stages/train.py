"""The two GRPO stages, one loop (the seed's section 5):

- ``warmup``: GRPO on the arithmetic curriculum, from ``checkpoints/sft``, writes ``checkpoints/warmup``.
- ``grpo``:   GRPO on GSM8K train, from ``checkpoints/warmup``, writes ``checkpoints/grpo``.

The frozen reference policy of both is the SFT checkpoint. One iteration: sample prompts, repeat
each G times (group-contiguous), roll out, score with the verifier, group advantages, old/ref
log-probs without grad, then ``grpo_epochs`` passes over minibatches of whole groups.

Resume: every ``save_every`` iterations the policy, optimizer, iteration, sampling RNG, data
position and series so far are written atomically to ``checkpoints/<stage>.resume/``; a re-run
after a kill continues from there and ends bit-identical (CPU) to an uninterrupted run. A finished
stage whose inputs and params are unchanged is not run again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import distributed as dist_utils
from pipeline.checkpoint import load_policy, save_policy
from pipeline.config import CHECKPOINT_DIR, DATA_DIR, PLOTS_DIR, Config, GRPOConfig, WarmupConfig, dump_config
from pipeline.errors import InputError, TrainingDivergedError
from pipeline.files import write_series_csv
from pipeline.grpo import group_advantages, grpo_loss, informative_fraction
from pipeline.rewards.verifiers import reward_for
from pipeline.rollout import Rollout, compute_logprobs, rollout_prompts
from pipeline.stages import train_state as ts
from pipeline.stages.prepare import read_jsonl_rows
from pipeline.stages.sft import greedy_accuracy
from pipeline.tracking import Logger, stage_logger
from pipeline.training import build_optimizer, lr_at, set_lr


STAGE_IO = {  # stage -> (init checkpoint, train file, held-out file)
    "warmup": ("sft", "arith_train.jsonl", "arith_eval.jsonl"),
    "grpo": ("warmup", "gsm8k_train.jsonl", "gsm8k_val.jsonl"),
}
REFERENCE = "sft"
CSV_COLUMNS = ["iteration", "reward", "reward_std", "informative", "kl", "clipfrac", "loss", "grad_norm",
               "response_len", "truncated", "entropy", "lr", "dropped_groups", "reward_sampled",
               "informative_sampled", "skipped_steps", "tokens_per_s", "accuracy"]


def run_warmup(cfg: Config) -> dict[str, Any]:
    return run_stage(cfg, "warmup")


def run_grpo(cfg: Config) -> dict[str, Any]:
    return run_stage(cfg, "grpo")


def run_stage(cfg: Config, stage: str) -> dict[str, Any]:
    g: GRPOConfig = getattr(cfg, stage)
    if g.nproc > 1 and not dist_utils.is_distributed():
        return _launch_torchrun(cfg, stage, g.nproc)
    return GRPOTrainer(cfg, stage).run()


# --------------------------------------------------------------------------- helpers

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _launch_torchrun(cfg: Config, stage: str, nproc: int) -> dict[str, Any]:
    """Re-run this stage under torchrun (DDP, one process per rank); rank 0 saves and logs."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(dump_config(cfg))
        params = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pipeline", stage, "--params", params]
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{stage}: torchrun with {nproc} processes failed (exit {exc.returncode})") from None
    finally:
        os.unlink(params)
    final = Path(CHECKPOINT_DIR) / stage / "state.json"
    return json.loads(final.read_text()).get("summary", {}) if final.is_file() else {}


# --------------------------------------------------------------------------- the trainer

class GRPOTrainer:
    """State and steps of one GRPO stage; `run()` is the whole loop."""

    def __init__(self, cfg: Config, stage: str) -> None:
        if stage not in STAGE_IO:
            raise ValueError(f"stage={stage!r}; allowed: {', '.join(STAGE_IO)}")
        self.cfg, self.stage = cfg, stage
        self.g: GRPOConfig = getattr(cfg, stage)
        init_name, train_file, eval_file = STAGE_IO[stage]
        self.init_dir = Path(CHECKPOINT_DIR) / init_name
        self.ref_dir = Path(CHECKPOINT_DIR) / REFERENCE
        self.out_dir = Path(CHECKPOINT_DIR) / stage
        self.resume_dir = Path(CHECKPOINT_DIR) / f"{stage}.resume"
        self.csv_path = Path(PLOTS_DIR) / f"{stage}.csv"
        self.train_path = Path(DATA_DIR) / train_file
        self.eval_path = Path(DATA_DIR) / eval_file
        self.rank, self.world = dist_utils.rank(), dist_utils.world_size()
        if self.g.prompts_per_iter % self.world:
            raise InputError(f"{stage}.prompts_per_iter = {self.g.prompts_per_iter} must be divisible by "
                             f"{stage}.nproc = {self.world} (prompts are sharded by rank)")

    # ------------------------------------------------------------------ fingerprint

    def fingerprint(self) -> str:
        """Hash of everything the stage's result depends on: params, init/ref weights, data."""
        h = hashlib.sha256()
        h.update(json.dumps({"stage": dataclasses.asdict(self.g), "model": dataclasses.asdict(self.cfg.model),
                             "template": self.cfg.data.prompt_template}, sort_keys=True).encode())
        for p in sorted(self.init_dir.glob("*.safetensors")) + sorted(self.ref_dir.glob("*.safetensors")):
            h.update(_sha256(p).encode())
        h.update(_sha256(self.train_path).encode())
        h.update(_sha256(self.eval_path).encode())
        return h.hexdigest()

    def _finished(self, fp: str) -> dict[str, Any] | None:
        state = self.out_dir / "state.json"
        if not state.is_file():
            return None
        try:
            data = json.loads(state.read_text())
        except json.JSONDecodeError:
            return None
        return data.get("summary") if data.get("fingerprint") == fp else None

    def _fitting(self, rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
        """Rows whose prompt leaves room for `rollout_len` new tokens in the model's context."""
        limit = self.policy.max_len
        if limit is None:
            return rows
        budget = limit - self.g.rollout_len
        tok = self.policy.tokenizer
        kept = [r for r in rows if len(tok.encode(r["prompt"])) <= budget]
        if len(kept) < len(rows):
            print(f"{self.stage}: {len(rows) - len(kept)} of {len(rows)} prompts in {path} leave no room for "
                  f"{self.stage}.rollout_len = {self.g.rollout_len} tokens in the {limit}-token context; skipped")
        if not kept:
            raise InputError(f"{path}: no prompt fits model.block_size = {limit} with {self.stage}.rollout_len = "
                             f"{self.g.rollout_len}; raise model.block_size or lower the rollout length")
        return kept

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        for p in (self.init_dir, self.ref_dir):
            if not (p / "config.json").is_file():
                raise InputError(f"{p}: checkpoint not found (run the stage that writes it first)")
        self._read_rows()
        fp = self.fingerprint()
        done = self._finished(fp)
        if done is not None:
            print(f"{self.stage}: up to date ({self.out_dir}), nothing to do")
            return done

        self.setup()
        resumed = ts.load_resume(self.resume_dir, fp, self)
        is_main = self.rank == 0
        logger_cm = stage_logger(self.cfg, self.stage, enabled=is_main)
        with logger_cm as log:
            if is_main:
                log.log_params(self.cfg.flat())
                log.set_tags({"stage": self.stage, "resumed_from": str(resumed or 0)})
            self._loop(log, fp)
            summary = self._finish(log, fp)
        dist_utils.barrier()
        return summary

    def _read_rows(self) -> None:
        self.train_rows = read_jsonl_rows(self.train_path)
        self.eval_rows = read_jsonl_rows(self.eval_path)[: self.g.eval_samples]

    def setup(self) -> None:
        """Policy, reference, optimizer, RNG and sampler at iteration 0: all `iteration()` needs
        (`run()` calls it; benchmarks call it, then `iteration()`, with no logging or saving)."""
        if not hasattr(self, "train_rows"):
            self._read_rows()
        torch.manual_seed(self.g.seed)
        self.policy = load_policy(self.init_dir, device=self.cfg.model.device)
        dist_utils.use_device(self.policy.device)  # NCCL collectives need tensors on the GPU
        self.train_rows = self._fitting(self.train_rows, self.train_path)
        self.eval_rows = self._fitting(self.eval_rows, self.eval_path)
        self.policy.eval()  # GRPO runs the policy without dropout; eval() does not stop gradients
        self.ref = load_policy(self.ref_dir, device=self.policy.device).frozen_copy() if self.g.kl_coef > 0 else None
        if self.world > 1:
            self.policy.runner = dist_utils.wrap_ddp(self.policy.module)
        self.optimizer = build_optimizer(self.policy.module, self.g.lr, self.g.weight_decay)
        # sampling draws on the policy's device: a CUDA op cannot take a CPU generator
        self.gen = torch.Generator(device=self.policy.device).manual_seed(self.g.seed * 1000 + self.rank)
        self.sampler = ts.PromptSampler(len(self.train_rows), self.g.seed)
        self.series: list[dict[str, Any]] = []
        self.it, self.nonfinite_run, self.skipped = 0, 0, 0
        self.total_iters = self.g.iterations
        self.adaptive_log: list[str] = []

    def _loop(self, log: Logger, fp: str) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        is_main = self.rank == 0
        cols = [TextColumn(f"[bold]{self.stage}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
        with Progress(*cols, disable=not is_main, transient=False) as bar:
            # no live bar in a log file or under CI: print one plain line per logged iteration instead
            plain = is_main and not bar.console.is_terminal
            task = bar.add_task(self.stage, total=self.total_iters, completed=self.it, info="")
            while self.it < self.total_iters:
                metrics, samples = self.iteration()
                self.it += 1
                if self.g.eval_every and (self.it % self.g.eval_every == 0 or self.it == self.total_iters):
                    metrics["accuracy"] = self.evaluate()
                self._adapt(metrics)
                row = {"iteration": self.it, **{k: metrics.get(k) for k in CSV_COLUMNS[1:]}}
                self.series.append(row)
                if is_main and (self.it % self.g.log_every == 0 or self.it == self.total_iters):
                    log.log_metrics({f"train/{k}": v for k, v in metrics.items() if v is not None}, step=self.it)
                    if samples:  # one table per stage, appended to (MLflow caps the number of table names)
                        log.log_table([{"iteration": self.it, **s} for s in samples], f"samples/{self.stage}.json")
                # the policy's reward and informative fraction over every group rolled out; with dynamic
                # sampling also the kept batch's (filtered towards informative groups)
                kept = (f" (kept {metrics['reward']:.3f} / {metrics['informative']:.2f})"
                        if self.g.dynamic_sampling else "")
                info = (f"reward {metrics['reward_sampled']:.3f}  inf {metrics['informative_sampled']:.2f}{kept}"
                        f"  kl {metrics['kl']:.4f}"
                        + (f"  acc {metrics['accuracy']:.3f}" if metrics.get("accuracy") is not None else ""))
                bar.update(task, completed=self.it, total=self.total_iters, info=info)
                if plain and (self.it % self.g.log_every == 0 or self.it == self.total_iters):
                    print(f"{self.stage} {self.it}/{self.total_iters}  {info}", flush=True)
                if self.it % self.g.save_every == 0 and self.it < self.total_iters and is_main:
                    ts.save_resume(self.resume_dir, fp, self)
                    write_series_csv(self.csv_path, self.series, CSV_COLUMNS)

    # ------------------------------------------------------------------ one iteration

    def _score(self, rows: list[dict[str, Any]], texts: list[str]) -> torch.Tensor:
        """Verifier rewards of group-contiguous completions (completion i answers rows[i // G])."""
        G = self.g.group_size
        return torch.tensor([reward_for(rows[i // G]["source"])(t, rows[i // G]["gold"]) for i, t in enumerate(texts)])

    def _sample_groups(self) -> tuple[list[dict[str, Any]], Rollout, torch.Tensor, int, dict[str, float],
                                      torch.Tensor]:
        """Roll out prompts_per_iter groups (this rank's shard) and score them; with dynamic sampling,
        replace zero-variance groups with fresh prompts for up to max_sampling_rounds rounds.
        Returns the kept rows, their rollout and rewards, the number of groups dropped, the phase
        times, and the (groups, G) rewards of every group sampled, the dropped ones included."""
        g, G = self.g, self.g.group_size
        per_rank = g.prompts_per_iter // self.world
        kept_rows: list[dict[str, Any]] = []
        kept: list[tuple[Rollout, list[int]]] = []
        kept_rewards: list[torch.Tensor] = []
        sampled: list[torch.Tensor] = []
        dropped, rounds, times = 0, 0, {"rollout": 0.0, "scoring": 0.0}
        while rounds < g.max_sampling_rounds:
            need = per_rank - len(kept_rows)
            # all ranks draw together (same sampler positions, disjoint prompts) until none needs more
            need_max = dist_utils.max_across_ranks(need)
            if need_max == 0:
                break
            idx = self.sampler.next_shard(need, need_max, self.rank, self.world)
            rounds += 1
            if not idx:  # this rank is full; it still drew so that its sampler stays in step
                continue
            rows = [self.train_rows[i] for i in idx]
            t0 = time.perf_counter()
            ro = rollout_prompts(self.policy, [r["prompt"] for r in rows], G, g.rollout_len, g.temperature,
                                 g.top_p, g.top_k, generator=self.gen)
            t1 = time.perf_counter()
            rewards = self._score(rows, ro.texts).view(-1, G)          # (prompts, G)
            times["rollout"] += t1 - t0
            times["scoring"] += time.perf_counter() - t1
            sampled.append(rewards)
            informative = rewards.std(dim=1) > 1e-6
            for j, row in enumerate(rows):
                # a zero-variance group has zero advantages: it carries no policy gradient (DAPO drops it)
                if g.dynamic_sampling and not informative[j] and rounds < g.max_sampling_rounds:
                    dropped += 1
                    continue
                kept_rows.append(row)
                kept.append((ro, list(range(j * G, (j + 1) * G))))
                kept_rewards.append(rewards[j])
            if not g.dynamic_sampling:
                break
        rollout = ts.select_rollouts(kept[:per_rank], self.policy.tokenizer.pad_id)
        return kept_rows[:per_rank], rollout, torch.cat(kept_rewards[:per_rank]), dropped, times, torch.cat(sampled)

    def _sync(self) -> None:
        """Wait for queued CUDA work, so that the phase timings are the phases' own (no-op on CPU)."""
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize(self.policy.device)

    def iteration(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        g, G = self.g, self.g.group_size
        t_start = time.perf_counter()
        rows, ro, rewards, dropped, times, sampled = self._sample_groups()
        adv = group_advantages(rewards, G, norm=g.adv_norm)
        ids, attn, resp = ro.input_ids, ro.attention_mask, ro.response_mask
        start = ro.prompt_len  # responses start here: no vocabulary projection over the prompts
        self._sync()
        t_lp = time.perf_counter()
        single_step = g.grpo_epochs == 1 and (g.minibatch_groups in (0, g.prompts_per_iter // self.world))
        with torch.inference_mode():
            # One optimizer step per iteration: the policy has not moved since sampling, so
            # old = new.detach() exactly (TRL does the same); otherwise recompute under no grad.
            old_lp = None if single_step else compute_logprobs(self.policy, ids, attn, g.temperature, start=start, group_size=G)
            ref_lp = (compute_logprobs(self.ref, ids, attn, g.temperature, start=start, group_size=G)
                      if self.ref is not None else None)
        self._sync()
        t_upd = time.perf_counter()
        lr = lr_at(self.it, self.total_iters, g.lr, g.warmup_iters, g.lr_schedule)
        set_lr(self.optimizer, lr)
        stats = self._update(ids, attn, resp, adv, old_lp, ref_lp, start)
        self._sync()
        t_end = time.perf_counter()

        resp_f = resp.float()
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
        groups = sampled.shape[0]
        r_sum, r_n, inf_n, groups, dropped = dist_utils.sum_across_ranks([
            sampled.sum().item(), sampled.numel(), informative_fraction(sampled.view(-1), G) * groups, groups, dropped])
        metrics.update({
            "reward_sampled": r_sum / max(r_n, 1.0), "informative_sampled": inf_n / max(groups, 1.0),
            "lr": lr, "dropped_groups": int(dropped), "skipped_steps": self.skipped,
            "tokens_per_s": n_tok * self.world / max(t_end - t_start, 1e-9),
            "time_rollout": times["rollout"], "time_scoring": times["scoring"], "time_logprobs": t_upd - t_lp,
            "time_update": t_end - t_upd,
        })
        samples = [{"prompt": rows[i // G]["question"][:200], "completion": ro.texts[i], "reward": rewards[i].item(),
                    "gold": rows[i // G]["gold"]} for i in range(0, min(len(ro.texts), 3 * G), G)]
        return metrics, samples

    def _update(self, ids, attn, resp, adv, old_lp, ref_lp, start: int = 1) -> dict[str, float]:
        g, G = self.g, self.g.group_size
        n = ids.shape[0]
        mb_groups = g.minibatch_groups or n // G
        mb = mb_groups * G
        acc: dict[str, list[float]] = {}
        for _ in range(g.grpo_epochs):
            for s in range(0, n, mb):
                sl = slice(s, s + mb)
                new_lp = compute_logprobs(self.policy, ids[sl], attn[sl], g.temperature, start=start, group_size=G)
                old = new_lp.detach() if old_lp is None else old_lp[sl]
                ref = ref_lp[sl] if ref_lp is not None else None
                loss, st = grpo_loss(new_lp, old, ref, adv[sl], resp[sl], clip=g.clip, kl_coef=g.kl_coef,
                                     clip_high=g.clip_high or None, loss_agg=g.loss_agg, importance=g.importance,
                                     max_len=g.rollout_len)
                # DDP averages gradients over ranks; weight each rank's loss by its share of the
                # global normaliser so the update equals one process on the whole batch.
                loss = loss * dist_utils.loss_weight(resp[sl], g.loss_agg)
                self.optimizer.zero_grad(set_to_none=True)
                ok = bool(torch.isfinite(loss).item())
                if ok:
                    loss.backward()
                    gn = torch.nn.utils.clip_grad_norm_(self.policy.module.parameters(), g.grad_clip)
                    ok = bool(torch.isfinite(gn).item())
                if not dist_utils.all_true(ok):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.skipped += 1
                    self.nonfinite_run += 1
                    if self.nonfinite_run >= g.max_nonfinite:
                        raise TrainingDivergedError(
                            f"{self.stage}: {self.nonfinite_run} consecutive non-finite steps at iteration "
                            f"{self.it + 1}; stopped. The last good checkpoint in {self.resume_dir} is intact; "
                            f"lower {self.stage}.lr or raise {self.stage}.max_nonfinite")
                    continue
                self.nonfinite_run = 0
                self.optimizer.step()
                for k, v in {**st, "loss": loss.item(), "grad_norm": gn.item()}.items():
                    acc.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in acc.items()} if acc else {
            "kl": float("nan"), "clipfrac": float("nan"), "loss": float("nan"), "grad_norm": float("nan")}

    # ------------------------------------------------------------------ evaluation / adaptivity

    def evaluate(self) -> float | None:
        """Greedy accuracy on the held-out slice (rank 0's figure; all ranks compute the same)."""
        return greedy_accuracy(self.policy, self.eval_rows, self.g.rollout_len)

    def _adapt(self, metrics: dict[str, Any]) -> None:
        """Adaptive curriculum (warmup only): leave early, or stay longer while groups are uninformative."""
        g = self.g
        if not isinstance(g, WarmupConfig) or not g.adaptive:
            return
        acc = metrics.get("accuracy")
        decision = None
        if acc is not None and metrics["reward"] >= g.exit_reward and acc >= g.exit_accuracy:
            if self.it < self.total_iters:
                decision = (f"iteration {self.it}: reward {metrics['reward']:.3f} and accuracy {acc:.3f} "
                            f"passed the thresholds; leaving the warmup early")
                self.total_iters = self.it
        elif (self.it == self.total_iters and metrics["informative"] < g.min_informative
              and self.total_iters < g.iterations + g.max_extra_iters):
            self.total_iters += 1
            decision = (f"iteration {self.it}: informative {metrics['informative']:.2f} < {g.min_informative}; "
                        f"extending the warmup by one iteration")
        if decision:
            self.adaptive_log.append(decision)
            if self.rank == 0:
                print(decision)

    # ------------------------------------------------------------------ finish

    def _finish(self, log: Logger, fp: str) -> dict[str, Any]:
        last = self.series[-1] if self.series else {}
        first = self.series[0] if self.series else {}
        accs = [r["accuracy"] for r in self.series if r.get("accuracy") is not None]
        summary = {
            "checkpoint": str(self.out_dir), "iterations": self.it,
            "reward_first": first.get("reward"), "reward_last": last.get("reward"),
            "accuracy_last": accs[-1] if accs else None, "skipped_steps": self.skipped,
            "adaptive": self.adaptive_log,
        }
        if self.rank == 0:
            write_series_csv(self.csv_path, self.series, CSV_COLUMNS)
            save_policy(self.out_dir, self.policy, extra_state={"stage": self.stage, "fingerprint": fp,
                                                               "summary": summary})
            log.log_artifact(self.csv_path)
            shutil.rmtree(self.resume_dir, ignore_errors=True)
        return summary
