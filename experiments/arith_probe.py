"""Where a checkpoint stands on the held-out arithmetic set, per curriculum level: greedy accuracy,
mean accuracy of k samples at temperature 1, pass@k, and the share of problems whose k samples are
mixed (some right, some wrong: the informative groups of GRPO). Used to size the SFT and the warmup
(docs/results/cpu-defaults.md): a big gap between pass@k and greedy is headroom that sampling can reach.

With ``--errors`` it also sorts the wrong greedy answers by their first line that differs from the
worked gold solution (:func:`classify_error`): a wrong one-digit fact on the right operands, a
miscopied operand, or other. Lines are read with a small integer parser, never evaluated.

    python experiments/arith_probe.py checkpoints/sft [--k 8] [--data data/arith_eval.jsonl] [--errors]
    # last line: JSON with the overall and per-level figures
"""

import argparse
import collections
import json
import re

import torch

from pipeline.rewards.parsing import extract_answer
from pipeline.rewards.verifiers import answers_match
from pipeline.stages.evaluate import generate
from pipeline.train.checkpoint import load_policy


_LINE = re.compile(r"^(.*) = (-?\d+)\.$")


def calc(expr: str) -> int | None:
    """Value of ``a op b op c ...`` (integers, ``+ - *``, ``*`` first), or None if it is not that."""
    toks = expr.split()
    if len(toks) % 2 == 0 or not all(re.fullmatch(r"-?\d+", t) for t in toks[::2]):
        return None
    terms, signs = [int(toks[0])], []
    for op, tok in zip(toks[1::2], toks[2::2]):
        if op == "*":
            terms[-1] *= int(tok)
        elif op in ("+", "-"):
            signs.append(op)
            terms.append(int(tok))
        else:
            return None
    return terms[0] + sum(t if op == "+" else -t for op, t in zip(signs, terms[1:]))


def classify_error(solution: str, text: str) -> str:
    """Kind of the first line of a wrong answer `text` that differs from the gold `solution`:
    ``fact`` (the gold line's operands, a wrong result), ``copy`` (other operands, the result
    right for them or the gold line's result), ``both`` (other operands, a result right for
    neither), ``line`` (a line where the gold has none or an answer line), ``answer`` (all worked
    lines right, the final answer wrong) or ``format``."""
    gold, got = solution.strip().split("\n"), text.strip().split("\n")
    for g, m in zip(gold, got):
        if g.strip() == m.strip():
            continue
        gm, mm = _LINE.match(g.strip()), _LINE.match(m.strip())
        if mm is None:
            return "answer" if gm is None and "<answer>" in m else "format"
        if gm is None:
            return "line"
        if gm.group(1) == mm.group(1):
            return "fact"
        if gm.group(2) == mm.group(2) or calc(mm.group(1)) == int(mm.group(2)):
            return "copy"
        return "both"
    return "line"


def tally(rows: list[dict], greedy_ok: list[bool], hits: list[list[bool]]) -> dict[str, dict]:
    """Per level (and ``all``): the problems, greedy accuracy, mean sample accuracy, pass@k, and the
    share of problems whose k samples are neither all right nor all wrong (`mixed`: a GRPO group of
    them has a gradient from correctness, which a group all right or all wrong has not)."""
    per = collections.defaultdict(lambda: {"n": 0, "greedy": 0.0, "sample": 0.0, "pass": 0.0, "mixed": 0.0})
    for row, g, h in zip(rows, greedy_ok, hits, strict=True):
        for key in (row.get("level", 0), "all"):
            p = per[key]
            p["n"] += 1
            p["greedy"] += g
            p["sample"] += sum(h) / len(h)
            p["pass"] += any(h)
            p["mixed"] += any(h) and not all(h)
    return {str(key): {m: round(per[key][m] / per[key]["n"], 4) for m in ("greedy", "sample", "pass", "mixed")}
            | {"n": per[key]["n"]} for key in sorted(per, key=lambda k: (k == "all", str(k)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--k", type=int, default=8, help="samples per problem")
    ap.add_argument("--data", default="data/arith_eval.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--errors", action="store_true", help="classify the wrong greedy answers (first differing line)")
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
    def ok(text: str, row: dict) -> bool:
        return answers_match(extract_answer(text), row["gold"])

    greedy_ok = [ok(t, row) for t, row in zip(greedy, rows)]
    hits = [[ok(t, row) for t in samples[i * args.k:(i + 1) * args.k]] for i, row in enumerate(rows)]  # group-contiguous
    out = tally(rows, greedy_ok, hits)
    for key, p in out.items():
        name = f"level {key}" if key != "all" else "all"
        print(f"{name:8s} n={p['n']:4d}  greedy {p['greedy']:.3f}  sample {p['sample']:.3f}  "
              f"pass@{args.k} {p['pass']:.3f}  mixed@{args.k} {p['mixed']:.3f}")
    if args.errors:
        kinds = collections.Counter(classify_error(row["solution"], text)
                                    for row, text, right in zip(rows, greedy, greedy_ok) if not right)
        print("wrong greedy answers by first differing line: "
              + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
        out["errors"] = dict(kinds)
    print(json.dumps({"checkpoint": args.checkpoint, "k": args.k, **out}))


if __name__ == "__main__":
    main()
