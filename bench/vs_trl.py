"""Seconds per GRPO iteration: TRL's GRPOTrainer vs our GRPO stage (HF backend), same model, same workload.

Workload (both sides; every number a flag): one randomly initialised GPT-2 (``--layers`` x
``--width``, default 4 x 256, vocab 2048 BPE, built from a config and saved to a temp folder with a
HF tokenizer made from our BPE), ``--prompts`` 8 prompts of about ``--prompt-len`` 56 tokens (an
addition question after filler words) x ``--group`` 8 generations, exactly ``--new-tokens`` 32
completion tokens (TRL: ``min_new_tokens``; ours: no stop tokens), temperature 1.0,
``--beta`` = kl_coef = 0.04 (> 0: both run a reference forward), clip 0.2, one update
pass (TRL ``num_iterations=1``: old log-probs = new.detach() on both), token-mean loss (TRL
``loss_type="dapo"``), per-group reward scaling, AdamW lr 2e-5, CPU, ``--dtype`` float32 (or
bfloat16: bf16 autocast over fp32 weights on both sides, TRL ``bf16=True`` and our
``model.dtype: bfloat16``; for a CPU with bf16 kernels), no vLLM, no
checkpoints (TRL ``save_strategy="no"``, ``report_to="none"``), no gradient checkpointing (TRL's
default is on; ours has none, so it is turned off for a like-for-like figure). Reward on both sides: our
verifier (``reward_for("arith")``) on the arithmetic prompts (the whole dataset, so every iteration
uses all of them on both sides).

Alternation: TRL's training loop drives; a callback runs ONE of our iterations after each TRL step
(not counted in TRL's time), so machine load drifts hit both alike. TRL's time per step is the
wall time between consecutive ``on_step_end`` calls minus our iteration, i.e. everything TRL does
per step. The first step of each is a warm-up and dropped. The speed-up is paired: TRL's step i
over our iteration i (run right after it), median (min, max) over the repeats.

``--ab-formula-gelu``: an extra arm after ours, the same iteration with GPT-2's GELU as transformers'
eight-op formula instead of one op (``fused_gelu_speedup``: formula / one op, paired).

``--init DIR``: a real model instead of the random GPT-2: any Hugging Face causal LM folder (weights,
tokenizer; e.g. the SmolLM2 recipe's converted ``recipes/smollm2/model``), loaded in fp32 on both sides;
each prompt is the pipeline's default template (question + answer-format instruction) rendered by
the tokenizer's chat template as the prepare stage renders it (``data.chat_template``), given to both
sides as the same text (``--prompt-len`` is then unused).

``--grid``: the same in one fresh process per cell over short / long prompts (20 / 128 tokens),
32 / 128-token completions and G 8 / 16 (other flags passed through), a table of the paired ratios.

    make bench-venv && .venv-bench/bin/python bench/vs_trl.py [--repeats 3] [--prompt-len 56] [--new-tokens 32]
        [--group 8] [--prompts 8] [--layers 4] [--width 256] [--beta 0.04] [--ab-shared-prefix]
        [--ab-formula-gelu] [--dtype float32|bfloat16] [--grid] [--init DIR]

The last line printed is a JSON object with ``trl_s``, ``ours_s`` and ``speedup`` (min/median/max of
the paired trl / ours ratios) and ``ours_phases_s`` (our timed iterations' rollout, log-prob and update
phases, from the iteration's own timers); with ``--grid``, ``cells`` holds one such object per cell.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GRPOIterations, arith_rows, emit, fmt_ratios, load_avg, machine_line, median, pair_ratios,
                    synthetic_corpus, workdir, write_rows)

import torch

CLIP, LR = 0.2, 2e-5
PHASES = ("rollout", "logprobs", "update")  # our iteration's phase timers (pipeline.stages.grpo)
GRID = {"prompt_len": (20, 128), "new_tokens": (32, 128), "group": (8, 16)}
FILLER = "Read the question below and think before you answer it . ".split()


def workload_rows(n: int, prompt_len: int, bpe) -> list[dict]:
    """`n` addition rows whose prompts are filler words then the question: about `prompt_len` tokens."""
    rows = arith_rows(n)
    for r in rows:
        words, prompt = [], r["question"]
        while len(bpe.encode(prompt)) < prompt_len:
            words.append(FILLER[len(words) % len(FILLER)])
            prompt = " ".join(words) + " " + r["question"]
        r["prompt"] = prompt
    return rows


def build_model(folder: Path, layers: int, width: int) -> tuple[int, object]:
    """Save a random GPT-2 + HF tokenizer to `folder`; return (param count, our BPE tokenizer)."""
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from pipeline.data.tokenizer import EOS, PAD, train_tokenizer

    bpe = train_tokenizer(synthetic_corpus(), vocab_size=2048)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=bpe.vocab_size, n_positions=512, n_embd=width, n_layer=layers, n_head=4,
                     bos_token_id=bpe.eos_id, eos_token_id=bpe.eos_id, pad_token_id=bpe.pad_id)
    model = GPT2LMHeadModel(cfg)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token=PAD, eos_token=EOS)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()), bpe


def chat_rows(n: int, model_dir: Path) -> tuple[list[dict], object]:
    """`n` addition rows whose prompts are the default template in `model_dir`'s chat template, and the
    model's tokenizer (pipeline.model.hf's wrapper: ``encode``, ``chat_prompt``)."""
    from pipeline.data.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(str(model_dir))
    rows = arith_rows(n)
    for r in rows:
        r["prompt"] = tok.chat_prompt(r["prompt"], "")
    return rows, tok


def count_params(model_dir: Path) -> int:
    """Parameters stored in `model_dir`'s safetensors files (a tied matrix once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total


def ours_trainer(model_dir: Path, data: list[dict], args):
    """Our GRPO stage's iterations on the HF backend, in the cwd (data/ and checkpoints/ written here)."""
    from pipeline.core.config import CHECKPOINT_DIR
    from pipeline.core.config_loading import config_from_dict
    from pipeline.model.policy import build_policy
    from pipeline.rl import group_sampling
    from pipeline.train.checkpoint import save_policy

    write_rows(data)
    model = {"backend": "hf", "init": str(model_dir), "device": "cpu", "dtype": args.dtype}
    cfg = config_from_dict({
        "model": model, "tracking": {"enabled": False},
        "grpo": {"iterations": 1000, "prompts_per_iter": args.prompts, "group_size": args.group,
                 "rollout_len": args.new_tokens, "temperature": 1.0, "kl_coef": args.beta, "clip": CLIP, "grpo_epochs": 1, "minibatch_groups": 0,
                 "lr": LR, "weight_decay": 0.0, "loss_agg": "token-mean", "adv_norm": "group", "eval_every": 0},
    }, "vs_trl")
    policy = build_policy(cfg.model)
    for name in ("sft", "warmup"):
        save_policy(Path(CHECKPOINT_DIR) / name, policy)
    # exactly args.new_tokens per completion, as on the TRL side: no stop tokens
    group_sampling.rollout_prompts = functools.partial(group_sampling.rollout_prompts, stop_ids=[])
    return GRPOIterations(cfg, "grpo")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed iterations of each after one warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts per iteration")
    ap.add_argument("--prompt-len", type=int, default=56, help="prompt tokens (about: filler words + a question)")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion tokens (exactly, on both sides)")
    ap.add_argument("--group", type=int, default=8, help="generations per prompt (G)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference forward on either side)")
    ap.add_argument("--ab-shared-prefix", action="store_true",
                    help="also time our iteration with the shared-prompt log-prob path off (an extra arm after ours)")
    ap.add_argument("--ab-formula-gelu", action="store_true",
                    help="also time our iteration with GPT-2's GELU as transformers' formula (an extra arm)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype on both sides: bfloat16 is bf16 autocast over fp32 weights (TRL bf16=True)")
    ap.add_argument("--grid", action="store_true", help="every cell of the grid, one fresh process each")
    ap.add_argument("--init", default=None, metavar="DIR",
                    help="a Hugging Face causal LM folder to time instead of the random GPT-2 (chat-formatted prompts)")
    return ap.parse_args(argv)


def run_grid(args) -> None:
    cells = []
    for prompt_len, new_tokens, group in itertools.product(*GRID.values()):
        flags = ["--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens), "--group", str(group)]
        for name in ("repeats", "threads", "layers", "width", "prompts", "beta", "dtype"):
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        flags += ["--init", str(Path(args.init).resolve())] if args.init else []
        arms = ("ab_shared_prefix", "ab_formula_gelu")  # the A/B arms run in every cell too
        flags += [f"--{name.replace('_', '-')}" for name in arms if getattr(args, name)]
        out = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True, check=True).stdout
        cell = json.loads(out.strip().splitlines()[-1])
        cells.append(cell)
        print(f"  prompt {cell['prompt_tokens']:5.1f} tok, {new_tokens:3d} new, G {group:2d}: "
              f"TRL {cell['trl_s']:.3f} s, ours {cell['ours_s']:.3f} s, TRL / ours {fmt_ratios(cell['speedup'])}"
              + "".join(f"; {label} {fmt_ratios(cell[key])}" for key, label in
                        (("shared_prefix_speedup", "shared prompts"), ("fused_gelu_speedup", "GELU as one op"))
                        if key in cell),
              flush=True)
    medians = [c["speedup"]["median"] for c in cells]
    print(f"grid: paired TRL / ours medians {min(medians):.2f}x - {max(medians):.2f}x over {len(cells)} cells")
    emit({"bench": "vs_trl_grid", "cells": cells, "median_range": [min(medians), max(medians)]})


def main() -> None:
    args = parse_args()
    if args.grid:
        print(machine_line(args.threads))
        run_grid(args)
        return
    torch.set_num_threads(args.threads)

    import transformers
    import trl

    from pipeline.model.hf import _TanhGELU
    from pipeline.model.policy import Policy

    with workdir() as tmp:
        if args.init:
            model_dir = Path(args.init).resolve()
            n_params = count_params(model_dir)
            data, bpe = chat_rows(args.prompts, model_dir)
        else:
            model_dir = tmp / "model"
            n_params, bpe = build_model(model_dir, args.layers, args.width)
            data = workload_rows(args.prompts, args.prompt_len, bpe)
        prompt_tokens = sum(len(bpe.encode(r["prompt"])) for r in data) / len(data)
        ours = ours_trainer(model_dir, data, args)
        ours_times: list[float] = []
        ours_phases: list[dict[str, float]] = []  # the iteration's own phase timers
        plain_times: list[float] = []
        formula_times: list[float] = []
        trl_marks: list[float] = []

        def after_trl_step():
            trl_marks.append(time.perf_counter())
            t0 = time.perf_counter()
            metrics, _ = ours.iteration()
            ours_times.append(time.perf_counter() - t0)
            ours_phases.append({k: metrics[f"time_{k}"] for k in PHASES})
            if args.ab_shared_prefix:  # the same iteration with every group's prompt recomputed per row
                shared, Policy._shares_prompt = Policy._shares_prompt, lambda *a: False
                t0 = time.perf_counter()
                ours.iteration()
                plain_times.append(time.perf_counter() - t0)
                Policy._shares_prompt = shared
            if args.ab_formula_gelu:  # the same iteration with GPT-2's GELU as transformers' formula
                fused, _TanhGELU.forward = _TanhGELU.forward, lambda self, x: self.plain(x)
                t0 = time.perf_counter()
                ours.iteration()
                formula_times.append(time.perf_counter() - t0)
                _TanhGELU.forward = fused
            trl_marks.append(time.perf_counter())  # TRL's next step starts now

        t_start = time.perf_counter()
        trl_trainer(tmp, model_dir, data, args, after_trl_step).train()
        starts = [t_start] + trl_marks[1::2][:-1]
        trl_times = [end - start for start, end in zip(starts, trl_marks[0::2])]
    report(args, n_params, prompt_tokens, trl_times, ours_times, ours_phases, plain_times, formula_times,
           trl.__version__, transformers.__version__)


def trl_trainer(tmp: Path, model_dir: Path, data: list[dict], args, after_step):
    """TRL's GRPOTrainer on the same model and rows, calling `after_step()` after each of its steps."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.rewards.verifiers import reward_for

    verifier = reward_for("arith")

    def reward(completions, gold, **_):
        return [verifier(c, g) for c, g in zip(completions, gold)]

    class Interleave(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            after_step()

    config = GRPOConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1, num_generations=args.group, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        beta=args.beta, epsilon=CLIP, num_iterations=1, loss_type="dapo", scale_rewards="group",
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_steps=1 + args.repeats,
        save_strategy="no", report_to="none", logging_steps=10_000, use_cpu=True,
        bf16=args.dtype == "bfloat16", fp16=False, seed=0,
        gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0, log_completions=False)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "gold": r["gold"]} for r in data])
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Interleave()])
    torch.set_num_threads(args.threads)  # in case a library changed it
    return trainer


def report(args, n_params, prompt_tokens, trl_times, ours_times, ours_phases, plain_times, formula_times, trl_version,
           tf_version) -> None:
    timed = {"trl": trl_times[1:], "ours": ours_times[1:]}  # step i of TRL, then iteration i of ours
    speedup = pair_ratios(timed, "trl", "ours")
    trl_s, ours_s = median(timed["trl"]), median(timed["ours"])
    print(f"{machine_line(torch.get_num_threads())}; trl {trl_version}, transformers {tf_version}")
    model = f"{args.init}" if args.init else f"GPT-2 {args.layers}x{args.width}"
    print(f"{model}, {n_params / 1e6:.2f}M params, {args.prompts}x{args.group} completions "
          f"of {args.new_tokens} tokens, prompts of {prompt_tokens:.1f} tokens, beta {args.beta}, clip {CLIP}, "
          f"{args.dtype}, "
          "one update per iteration; " + ("chat-formatted prompts" if args.init else "random init"))
    print(f"  TRL GRPOTrainer  {trl_s:7.3f} s/iteration  (warm-up {trl_times[0]:.2f}s; "
          + ", ".join(f"{t:.3f}" for t in timed["trl"]) + ")")
    print(f"  ours (hf)        {ours_s:7.3f} s/iteration  (warm-up {ours_times[0]:.2f}s; "
          + ", ".join(f"{t:.3f}" for t in timed["ours"]) + ")")
    phases = {k: [ph[k] for ph in ours_phases[1:]] for k in PHASES}
    print("  ours by phase     " + ", ".join(f"{k} {min(v):.3f}-{max(v):.3f} s" for k, v in phases.items()))
    print(f"  speedup (TRL / ours, paired): {fmt_ratios(speedup)}")
    extra = {}
    if plain_times:
        timed["plain"] = plain_times[1:]
        shared = pair_ratios(timed, "plain", "ours")
        print(f"  ours, prompts recomputed per row {median(timed['plain']):7.3f} s/iteration: shared prompts "
              f"{fmt_ratios(shared)}")
        extra = {"ours_plain_s": round(median(timed["plain"]), 4), "shared_prefix_speedup": shared,
                 "ours_plain_times": [round(t, 4) for t in plain_times]}
    if formula_times:
        timed["formula"] = formula_times[1:]
        gelu = pair_ratios(timed, "formula", "ours")
        print(f"  ours, GPT-2's GELU as the formula {median(timed['formula']):7.3f} s/iteration: GELU as one op "
              f"{fmt_ratios(gelu)}")
        extra.update({"ours_formula_gelu_s": round(median(timed["formula"]), 4), "fused_gelu_speedup": gelu,
                      "ours_formula_gelu_times": [round(t, 4) for t in formula_times]})
    emit({"bench": "vs_trl", "trl_version": trl_version, "transformers_version": tf_version,
          "threads": args.threads, "model": args.init or "gpt2-random", "params": n_params, "prompt_len": args.prompt_len,
          "prompt_tokens": round(prompt_tokens, 1), "new_tokens": args.new_tokens, "group": args.group,
          "prompts": args.prompts, "beta": args.beta, "dtype": args.dtype, "load": load_avg(), "trl_s": round(trl_s, 4),
          "ours_s": round(ours_s, 4), "speedup": speedup, "trl_times": [round(t, 4) for t in trl_times],
          "ours_times": [round(t, 4) for t in ours_times],
          "ours_phases_s": {k: [round(t, 4) for t in v] for k, v in phases.items()}, **extra})


if __name__ == "__main__":
    main()
