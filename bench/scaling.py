"""Seconds per GRPO iteration for group size x rollout length: does cost grow linearly in tokens?

A small from-scratch GPT (default 2 x 128, vocab 2048 BPE, random init), ``--prompts`` arithmetic
prompts per iteration, G in {4, 8, 16} x rollout length in {32, 64, 128}, every completion forced
to full length (no stop tokens), kl_coef 0.04 (reference forward on), one update per iteration.
Each configuration has its own GRPO stage set-up (our real iteration: rollout, scoring, ref log-probs,
update); one warm-up iteration each, then ``--repeats`` rounds over all nine, alternating so load
drifts hit every cell alike; the median per cell.

Linear growth means seconds per generated token stays roughly flat across the table: the MLP and
projections are linear in tokens; attention adds a term linear in context length per token, so
s/token may creep up with length; fixed per-iteration overhead makes small cells cost more per token.

    .venv/bin/python bench/scaling.py [--repeats 2] [--threads 1] [--layers 2] [--width 128]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GRPOIterations, alternate, arith_rows, emit, machine_line, median, synthetic_corpus, workdir,
                    write_rows)

import torch

GROUPS, LENGTHS = (4, 8, 16), (32, 64, 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR
    from pipeline.core.config_loading import config_from_dict
    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.rl import group_sampling
    from pipeline.train.checkpoint import save_policy

    group_sampling.rollout_prompts = functools.partial(group_sampling.rollout_prompts, stop_ids=[])  # full length
    trainers, tokens = {}, {}
    with workdir():
        write_rows(arith_rows(64))
        tok = train_tokenizer(synthetic_corpus(), vocab_size=2048)
        tok.save(Path(DATA_DIR))
        model = {"backend": "gpt", "n_layer": args.layers, "n_head": 4, "n_embd": args.width, "block_size": 512,
                 "device": "cpu"}
        base = config_from_dict({"model": model, "tracking": {"enabled": False}}, "scaling")
        torch.manual_seed(0)
        policy = build_policy(base.model, tok)
        for name in ("sft", "warmup"):
            save_policy(Path(CHECKPOINT_DIR) / name, policy)
        for G in GROUPS:
            for L in LENGTHS:
                cfg = config_from_dict({"model": model, "tracking": {"enabled": False}, "grpo": {
                    "iterations": 1000, "prompts_per_iter": args.prompts, "group_size": G, "rollout_len": L,
                    "kl_coef": 0.04, "eval_every": 0}}, "scaling")
                tr = GRPOIterations(cfg, "grpo")
                trainers[(G, L)] = tr
                tokens[(G, L)] = args.prompts * G * L

        def step(tr):
            return tr.iteration

        times = alternate({k: step(tr) for k, tr in trainers.items()}, args.repeats)

    sec = {k: median(times[k]) for k in trainers}
    per_tok = {k: sec[k] / tokens[k] for k in trainers}
    print(machine_line(args.threads))
    print(f"GPT {args.layers}x{args.width}, {args.prompts} prompts/iteration, full-length rollouts; median of "
          f"{args.repeats} alternating rounds after a warm-up; random init")
    print("seconds per iteration (rows: G, columns: rollout length)")
    print(f"{'G':>4s} " + " ".join(f"{L:>9d}" for L in LENGTHS))
    for G in GROUPS:
        print(f"{G:>4d} " + " ".join(f"{sec[(G, L)]:9.3f}" for L in LENGTHS))
    print("milliseconds per generated token")
    for G in GROUPS:
        print(f"{G:>4d} " + " ".join(f"{1e3 * per_tok[(G, L)]:9.3f}" for L in LENGTHS))
    small, big = (GROUPS[0], LENGTHS[0]), (GROUPS[-1], LENGTHS[-1])
    growth = sec[big] / sec[small]
    print(f"{tokens[big] // tokens[small]}x the tokens ({small} -> {big}) cost {growth:.1f}x the time")
    emit({"bench": "scaling", "threads": args.threads, "model": f"{args.layers}x{args.width}",
          "prompts": args.prompts,
          "seconds": {f"G{G}_L{L}": round(sec[(G, L)], 4) for G in GROUPS for L in LENGTHS},
          "ms_per_token": {f"G{G}_L{L}": round(1e3 * per_tok[(G, L)], 4) for G in GROUPS for L in LENGTHS},
          "token_ratio": tokens[big] / tokens[small], "time_ratio": round(growth, 3)})


if __name__ == "__main__":
    main()
