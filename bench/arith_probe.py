"""Where a checkpoint stands on the held-out arithmetic set, per curriculum level: greedy accuracy,
mean accuracy of k samples at temperature 1, and pass@k. Used to size the SFT and the warmup
(docs/tuning.md): a big gap between pass@k and greedy is headroom that sampling can reach.

    python bench/arith_probe.py checkpoints/sft [--k 8] [--data data/arith_eval.jsonl]
    # last line: JSON with the overall and per-level figures
"""

import argparse
import collections
import json

import torch

from pipeline.checkpoint import load_policy
from pipeline.rewards.parsing import extract_answer
from pipeline.rewards.verifiers import answers_match
from pipeline.stages.evaluate import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--k", type=int, default=8, help="samples per problem")
    ap.add_argument("--data", default="data/arith_eval.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_policy(args.checkpoint)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["prompt"] for r in rows]
    greedy, _, _ = generate(policy, prompts, batch_size=100, max_new_tokens=args.max_new_tokens)
    gen = torch.Generator(device=policy.device).manual_seed(args.seed)
    samples, _, _ = generate(policy, prompts, batch_size=25, max_new_tokens=args.max_new_tokens,
                             group_size=args.k, greedy=False, generator=gen)
    per = collections.defaultdict(lambda: {"n": 0, "greedy": 0.0, "sample": 0.0, "pass": 0.0})
    for i, row in enumerate(rows):
        def ok(text: str, gold=row["gold"]) -> bool:
            return answers_match(extract_answer(text), gold)
        hits = [ok(t) for t in samples[i * args.k:(i + 1) * args.k]]  # group-contiguous
        for key in (row.get("level", 0), "all"):
            p = per[key]
            p["n"] += 1
            p["greedy"] += ok(greedy[i])
            p["sample"] += sum(hits) / args.k
            p["pass"] += any(hits)
    out = {}
    for key in sorted(per, key=lambda k: (k == "all", str(k))):
        p = per[key]
        out[str(key)] = {m: round(p[m] / p["n"], 4) for m in ("greedy", "sample", "pass")} | {"n": p["n"]}
        name = f"level {key}" if key != "all" else "all"
        print(f"{name:8s} n={p['n']:4d}  greedy {p['greedy'] / p['n']:.3f}  sample {p['sample'] / p['n']:.3f}  "
              f"pass@{args.k} {p['pass'] / p['n']:.3f}")
    print(json.dumps({"checkpoint": args.checkpoint, "k": args.k, **out}))


if __name__ == "__main__":
    main()
