"""Paired differences between the checkpoints a recipe's evaluate stage scored, from its predictions.

    python experiments/recipe_report.py recipes/smollm2                 # after `make run-instruct`
    python experiments/recipe_report.py recipes/smollm2 --against sft_fewshot --draws 20000

Every entry of ``metrics/eval.json`` was scored on the same problems (``reports/predictions_<entry>_
<task>.csv``, one row per problem in file order), so two entries differ problem by problem: the
difference in accuracy, its 95% interval from a seeded bootstrap over the problems (paired: a problem
is drawn with both entries' outcomes), and the count of problems only one of them solves; for the
held-out arithmetic also per curriculum level (the level is read from ``data/arith_eval.jsonl``).
Prints a markdown table per task and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path

TASKS = ("arith", "gsm8k")


def correct(folder: Path, entry: str, task: str) -> list[bool]:
    with open(folder / "reports" / f"predictions_{entry}_{task}.csv", newline="") as f:
        return [row["correct"] in ("True", "true", "1") for row in csv.DictReader(f)]


def paired(a: list[bool], b: list[bool], draws: int, seed: int = 0) -> dict:
    """a - b in accuracy points with a paired bootstrap 95% interval, and the discordant counts."""
    if len(a) != len(b) or not a:
        raise ValueError(f"entries scored {len(a)} and {len(b)} problems: not the same set")
    n, rng = len(a), random.Random(seed)
    diffs = [int(x) - int(y) for x, y in zip(a, b)]
    boot = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return {"diff": 100 * sum(diffs) / n, "low": 100 * boot[int(0.025 * draws)],
            "high": 100 * boot[int(0.975 * draws) - 1], "only_a": diffs.count(1), "only_b": diffs.count(-1), "n": n}


def levels(folder: Path) -> list[int]:
    return [int(json.loads(line).get("level", 0)) for line in (folder / "data" / "arith_eval.jsonl").open()]


def report(folder: Path, against: list[str], draws: int) -> dict:
    entries = list(json.loads((folder / "metrics" / "eval.json").read_text()))
    out: dict = {}
    for task in TASKS:
        for base in against:
            for entry in (e for e in entries if e not in against):
                a, b = correct(folder, entry, task), correct(folder, base, task)
                row = {"all": paired(a, b, draws)}
                if task == "arith":
                    lv = levels(folder)[:len(a)]
                    for level in sorted(set(lv)):
                        pick = [i for i, x in enumerate(lv) if x == level]
                        row[f"level{level}"] = paired([a[i] for i in pick], [b[i] for i in pick], draws)
                out[f"{task}: {entry} - {base}"] = row
    return out


def markdown(table: dict) -> str:
    lines = ["| task: a - b | part | a - b, points [95%] | only a / only b | problems |", "|---|---|---|---|---|"]
    for name, parts in table.items():
        for part, d in parts.items():
            lines.append(f"| {name} | {part} | {d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}] | "
                         f"{d['only_a']} / {d['only_b']} | {d['n']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the pipeline's folder (the repository root or recipes/NAME)")
    p.add_argument("--against", nargs="+", default=["sft", "sft_fewshot"], help="the baselines (eval.json entries)")
    p.add_argument("--draws", type=int, default=10000)
    args = p.parse_args(argv)
    table = report(args.folder, args.against, args.draws)
    print(markdown(table))
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
