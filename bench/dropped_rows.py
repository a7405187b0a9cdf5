"""Decoding a trained checkpoint with the finished rows dropped from the batch, or every row decoded
to the batch's end: greedy evaluation and sampled rollouts.

A trained policy answers in a few dozen to a few hundred tokens, so late in a batch most rows have
stopped. ``pipeline.rl.rollout`` drops them from the decoder's cache every ``COMPACT_EVERY`` steps
(``dropped``): any finished row where each prompt has one row (greedy evaluation, the held-out
checks), a whole group once all its G rows have finished where they share their prompt's keys
(GRPO rollouts, the evaluate stage's k samples). The reference arm (``every-row``) never drops a
row (``COMPACT_EVERY`` set past the budget): what the engine did before.

Workloads, from ``--params``:

- ``greedy``: each task's prepared file (``data/gsm8k_test.jsonl``, ``data/arith_eval.jsonl``) x each
  ``--batch`` size, at ``evaluate.max_new_tokens``, the first ``--limit`` problems;
- ``warmup`` and ``grpo``: the GRPO stages' rollouts: ``prompts_per_iter`` prompts of the stage's
  training file x ``group_size``, ``rollout_len`` new tokens, its temperature, ``--batches`` batches;
- ``samples``: the evaluate stage's k samples per problem (``evaluate.samples``) of the held-out
  arithmetic, ``evaluate.batch_size`` problems per batch, the first ``--limit`` problems.

Per workload the two arms alternate ``--repeats`` times in this process (one torch thread) after one
untimed warm-up pass each, each sampled pass from the same seed; the figure is each round's ratio
every-row / dropped, min / median / max. Each arm's completions are compared: they must be the same
text (the sampler gives each remaining row its own uniform of the whole batch). Also printed: the
fraction of the every-row arm's row-steps spent on rows still decoding (the work dropping can save).

    .venv/bin/python bench/dropped_rows.py [--checkpoint checkpoints/sft] [--data data] [--limit 256]
        [--batch 64 16] [--tasks gsm8k arith] [--workloads greedy warmup grpo samples] [--batches 4]
        [--repeats 3]

Run it in a workspace after the prepare stage and a training stage (``make run`` leaves both). The
last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, alternate, emit, fmt_ratios, machine_line, pair_ratios  # noqa: E402

sys.path.insert(0, str(ROOT))
TASK_FILES = {"gsm8k": "gsm8k_test.jsonl", "arith": "arith_eval.jsonl"}
TRAIN_FILES = {"warmup": "arith_train.jsonl", "grpo": "gsm8k_train.jsonl"}
WORKLOADS = ("greedy", "warmup", "grpo", "samples")


def shapes(args, cfg) -> list[dict]:
    """Every workload of the grid: a name, its prompts and how they are decoded."""
    from pipeline.stages.evaluate import load_rows

    out = []
    e = cfg.evaluate
    for workload in args.workloads:
        if workload == "greedy":
            for task in args.tasks:
                prompts = [r["prompt"] for r in load_rows(args.data / TASK_FILES[task], args.limit)]
                out += [{"workload": "greedy", "task": task, "prompts": prompts, "batch": b, "group": 1,
                         "budget": e.max_new_tokens, "greedy": True, "temperature": 1.0} for b in args.batch]
        elif workload in TRAIN_FILES:
            conf = getattr(cfg, workload)
            n = conf.prompts_per_iter * args.batches
            prompts = [r["prompt"] for r in load_rows(args.data / TRAIN_FILES[workload], n)]
            out.append({"workload": workload, "task": TRAIN_FILES[workload].split("_")[0], "prompts": prompts,
                        "batch": conf.prompts_per_iter, "group": conf.group_size, "budget": conf.rollout_len,
                        "greedy": False, "temperature": conf.temperature})
        elif e.samples > 0:
            prompts = [r["prompt"] for r in load_rows(args.data / TASK_FILES["arith"], args.limit)]
            out.append({"workload": "samples", "task": "arith", "prompts": prompts, "batch": e.batch_size,
                        "group": e.samples, "budget": e.max_new_tokens, "greedy": False,
                        "temperature": e.temperature})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("checkpoints/sft"))
    ap.add_argument("--data", type=Path, default=Path("data"), help="the prepare stage's output folder")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--tasks", nargs="+", default=["gsm8k", "arith"], choices=sorted(TASK_FILES),
                    help="tasks of the greedy workload")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 16], help="prompts per batch (greedy)")
    ap.add_argument("--limit", type=int, default=256, help="problems of each evaluation task (0 = all)")
    ap.add_argument("--batches", type=int, default=4, help="rollout batches of the warmup and grpo workloads")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    import pipeline.rl.rollout as ro
    from pipeline.core.config_loading import load_config
    from pipeline.rl.generation import generate
    from pipeline.train.checkpoint import load_policy

    torch.set_num_threads(1)
    cfg = load_config(args.params)
    print(machine_line(1))
    print(f"checkpoint {args.checkpoint}, {args.repeats} rounds")
    policy = load_policy(args.checkpoint, device="cpu")
    policy.eval()
    every = ro.COMPACT_EVERY
    results = []
    for w in shapes(args, cfg):
        outputs = {}

        def arm(name: str, compact_every: int, w=w):
            def run():
                ro.COMPACT_EVERY = compact_every
                try:
                    outputs[name] = generate(policy, w["prompts"], batch_size=w["batch"], max_new_tokens=w["budget"],
                                             group_size=w["group"], greedy=w["greedy"], temperature=w["temperature"],
                                             generator=torch.Generator().manual_seed(0))
                finally:
                    ro.COMPACT_EVERY = every
            return run

        times = alternate({"every-row": arm("every-row", w["budget"] + 1), "dropped": arm("dropped", every)},
                          args.repeats)
        same = outputs["every-row"][0] == outputs["dropped"][0]
        lengths, rows = outputs["every-row"][1], w["batch"] * w["group"]
        steps = sum(max(lengths[s:s + rows]) * len(lengths[s:s + rows]) for s in range(0, len(lengths), rows))
        useful = round(sum(lengths) / steps, 3)
        ratio = pair_ratios(times, "every-row", "dropped")
        label = f"{w['workload']:7s} {w['task']:5s} {len(w['prompts'])} prompts x {w['group']}, batch {w['batch']:3d}"
        print(f"{label}: every row {min(times['every-row']):.2f} s, dropped {min(times['dropped']):.2f} s: "
              f"{fmt_ratios(ratio)}; same completions: {same}; row-steps on rows still decoding: {100 * useful:.1f}%")
        results.append({"workload": w["workload"], "task": w["task"], "problems": len(w["prompts"]),
                        "batch": w["batch"], "group": w["group"], "budget": w["budget"], "speedup": ratio,
                        "same_completions": same, "useful_row_steps": useful,
                        "every_row_s": times["every-row"], "dropped_s": times["dropped"]})
    emit({"bench": "dropped_rows", "checkpoint": str(args.checkpoint), "workloads": results})


if __name__ == "__main__":
    main()
