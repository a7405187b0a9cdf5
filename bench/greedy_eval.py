"""Greedy evaluation of a trained checkpoint: the rows that stopped dropped from the batch, or every
row decoded to the batch's end.

The evaluate stage and the training stages' held-out checks decode one greedy completion per
prompt, in fixed batches. A trained policy answers in a few dozen to a few hundred tokens, so late
in a batch most rows have stopped; ``pipeline.rollout`` drops them from the decoder's cache every
``COMPACT_EVERY`` steps (``compacted``). The reference arm (``every-row``) never drops a row
(``COMPACT_EVERY`` set past the budget): what the engine did before.

Workloads (a grid): each task's prepared file (``data/gsm8k_test.jsonl``, ``data/arith_eval.jsonl``)
x each ``--batch`` size, at the evaluate stage's budget (``--max-new-tokens``, default
``evaluate.max_new_tokens`` of ``--params``), the first ``--limit`` problems. Per workload the two
arms alternate ``--repeats`` times in this process (one torch thread) after one untimed warm-up
pass each; the figure is each round's ratio every-row / compacted, min / median / max. Each arm's
completions are compared: they must be the same text.

Also printed per workload: the fraction of row-steps the every-row arm spends on rows still
decoding (the work compaction can save).

    .venv/bin/python bench/greedy_eval.py [--checkpoint checkpoints/sft] [--data data] [--limit 256]
        [--batch 64 16] [--tasks gsm8k arith] [--repeats 3]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("checkpoints/sft"))
    ap.add_argument("--data", type=Path, default=Path("data"), help="the prepare stage's output folder")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--tasks", nargs="+", default=["gsm8k", "arith"], choices=sorted(TASK_FILES))
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 16], help="prompts per batch")
    ap.add_argument("--limit", type=int, default=256, help="problems of each task (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: evaluate.max_new_tokens of --params")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    import pipeline.rollout as ro
    from pipeline.checkpoint import load_policy
    from pipeline.config_loading import load_config
    from pipeline.generation import generate
    from pipeline.stages.evaluate import load_rows

    torch.set_num_threads(1)
    budget = args.max_new_tokens or load_config(args.params).evaluate.max_new_tokens
    print(machine_line(1))
    print(f"checkpoint {args.checkpoint}, budget {budget} new tokens, {args.repeats} rounds")
    policy = load_policy(args.checkpoint, device="cpu")
    policy.eval()
    every = ro.COMPACT_EVERY
    results = []
    for task in args.tasks:
        rows = load_rows(args.data / TASK_FILES[task], args.limit)
        prompts = [r["prompt"] for r in rows]
        for batch in args.batch:
            outputs = {}

            def arm(name: str, compact_every: int, batch=batch, prompts=prompts):
                def run():
                    ro.COMPACT_EVERY = compact_every
                    try:
                        outputs[name] = generate(policy, prompts, batch_size=batch, max_new_tokens=budget)
                    finally:
                        ro.COMPACT_EVERY = every
                return run

            times = alternate({"every-row": arm("every-row", budget + 1), "compacted": arm("compacted", every)},
                              args.repeats)
            same = outputs["every-row"][0] == outputs["compacted"][0]
            lengths = outputs["every-row"][1]
            steps = sum(max(lengths[s:s + batch]) * len(lengths[s:s + batch]) for s in range(0, len(lengths), batch))
            useful = round(sum(lengths) / steps, 3)
            ratio = pair_ratios(times, "every-row", "compacted")
            print(f"{task:5s} {len(rows)} problems, batch {batch:3d}: every row {min(times['every-row']):.2f} s, "
                  f"compacted {min(times['compacted']):.2f} s: {fmt_ratios(ratio)}; same completions: {same}; "
                  f"row-steps on rows still decoding: {100 * useful:.1f}%")
            results.append({"task": task, "problems": len(rows), "batch": batch, "speedup": ratio,
                            "same_completions": same, "useful_row_steps": useful,
                            "every_row_s": times["every-row"], "compacted_s": times["compacted"]})
    emit({"bench": "greedy_eval", "checkpoint": str(args.checkpoint), "budget": budget, "workloads": results})


if __name__ == "__main__":
    main()
