"""Choose between a recipe's trained checkpoints on a validation set, never on its held-out test.

    python experiments/recipe_select.py recipes/smollm2 current=runs/a/checkpoints/warmup \\
        informative=runs/b/checkpoints/warmup [--size 300] [--seed 1] [--fewshot 4] [--out runs/select.json]

A hyperparameter picked by its held-out test score is fitted to that test, and the score then
overstates it. So a choice between settings is made here: on arithmetic problems drawn afresh
(seeded by ``--seed``, every level equally often as far as each level has distinct problems left),
none of whose expressions is in the recipe's held-out set (``data/arith_eval.jsonl``) or in its
training stream (``data/arith_train.jsonl``, which the warmup draws its prompts from, so a problem
there may have been trained on), asked in the same phrasings and prompt, scored greedily by the
evaluate stage's own code (``evaluate_task``: ``evaluate.max_new_tokens``, the verifier). A small
level can run out: level 1 has 155 distinct expressions, and a held-out set of 100 per level with a
training stream of thousands takes them all, so the draw then has no level-1 problem. The first
checkpoint is the reference: every other one gets its paired difference to it, with a seeded
bootstrap interval (``recipe_report.paired``), overall and per level. ``--fewshot N`` asks every
checkpoint after N worked examples instead, as the evaluate stage's few-shot entries do (the first N
rows of ``data/arith_train.jsonl``, ``pipeline.data.prompts.fewshot_prompt``): a choice between
prompted baselines, such as the examples' solution format, is then made here too. Prints a
markdown table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: experiments/, pipeline/
from experiments.recipe_report import paired  # noqa: E402
from pipeline.data.arithmetic import MAX_LEVEL, PHRASINGS, sample_problem, to_row  # noqa: E402

_PHRASES = [re.compile("^" + re.escape(p).replace(re.escape("{e}"), "(?P<e>.+)") + "$") for p in PHRASINGS]
TRIES = 10_000


def expression(question: str) -> str:
    """The expression of a curriculum question (``"Compute 47 + 38."`` -> ``"47 + 38"``)."""
    for pattern in _PHRASES:
        m = pattern.match(question)
        if m:
            return m.group("e")
    raise ValueError(f"not a curriculum question: {question!r}")


def validation_rows(excluded: list[dict], size: int, max_level: int, seed: int, template: str,
                    style: str) -> list[dict]:
    """`size` problems (levels round-robin, shuffled by `seed`), distinct, none asking an expression of
    the `excluded` rows (the held-out set and the training stream); a level whose distinct problems
    run out gives fewer."""
    if not 1 <= max_level <= MAX_LEVEL:
        raise ValueError(f"max_level must be in 1..{MAX_LEVEL}, got {max_level}")
    rng = random.Random(f"arith-val-{seed}")
    taken = {expression(r["question"]) for r in excluded}
    levels = [1 + i % max_level for i in range(size)]
    rng.shuffle(levels)
    rows, exhausted = [], set()
    for level in levels:
        if level in exhausted:
            continue
        for _ in range(TRIES):
            p = sample_problem(level, rng)
            if p.expr not in taken:
                break
        else:
            exhausted.add(level)
            continue
        taken.add(p.expr)
        rows.append(to_row(p, f"arith-val-{len(rows):05d}", rng, template, style))
    return rows


def score(folder: Path, checkpoint: Path, rows: list[dict], threads: int,
          shots: list[tuple[str, str]] | None = None) -> list[dict]:
    """The evaluate stage's greedy predictions of `checkpoint` on `rows`, under `folder`'s params; after
    the worked examples `shots` ((question, solution) pairs) when given, as its few-shot entries."""
    import torch

    from pipeline.core.config_loading import load_config
    from pipeline.data.prompts import fewshot_prompt
    from pipeline.stages.evaluate import evaluate_task
    from pipeline.train.checkpoint import load_policy

    cfg = load_config(folder / "params.yaml")
    torch.set_num_threads(threads or cfg.model.num_threads or torch.get_num_threads())
    policy = load_policy(checkpoint, run=cfg.model)
    policy.eval()
    ask = ((lambda r: fewshot_prompt(r["question"], shots, policy.tokenizer, cfg.data)) if shots
           else (lambda r: rendered(r["prompt"], policy.tokenizer, cfg.data)))
    return evaluate_task(policy, [{**r, "prompt": ask(r)} for r in rows], cfg, samples=0)


def rendered(prompt: str, tokenizer, data) -> str:
    """`prompt` (the filled template) as the prepare stage writes it: the chat template's user turn
    after `data.system_prompt` when `data.chat_template`."""
    return tokenizer.chat_prompt(prompt, data.system_prompt) if data.chat_template else prompt


def table(rows: list[dict], scored: dict[str, list[dict]], draws: int) -> dict:
    """Accuracy and well-formed rate per checkpoint and level; paired differences to the first."""
    levels = sorted({r["level"] for r in rows})
    pick = {lv: [i for i, r in enumerate(rows) if r["level"] == lv] for lv in levels}
    out: dict = {"problems": {"all": len(rows), **{f"level{lv}": len(ix) for lv, ix in pick.items()}}, "entries": {}}
    names = list(scored)
    for name in names:
        ok = [bool(p["correct"]) for p in scored[name]]
        entry = {"all": 100 * sum(ok) / len(ok),
                 **{f"level{lv}": 100 * sum(ok[i] for i in ix) / len(ix) for lv, ix in pick.items()},
                 "well_formed": 100 * sum(bool(p["well_formed"]) for p in scored[name]) / len(ok)}
        if name != names[0]:
            ref = [bool(p["correct"]) for p in scored[names[0]]]
            entry["vs_" + names[0]] = {"all": paired(ok, ref, draws), **{
                f"level{lv}": paired([ok[i] for i in ix], [ref[i] for i in ix], draws) for lv, ix in pick.items()}}
        out["entries"][name] = entry
    return out


def markdown(result: dict) -> str:
    n = result["problems"]
    parts = [k for k in n if k != "all"]
    ref = next(iter(result["entries"]))
    head = ["checkpoint", f"validation ({n['all']})", *(f"{p} ({n[p]})" for p in parts), "well-formed",
            f"- {ref}, points [95%]", "only it / only ref"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in result["entries"].items():
        d = e.get("vs_" + ref, {}).get("all")
        diff = f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]" if d else ""
        counts = f"{d['only_a']} / {d['only_b']}" if d else ""
        lines.append("| " + " | ".join([name, f"{e['all']:.1f}%", *(f"{e[p]:.1f}%" for p in parts),
                                         f"{e['well_formed']:.1f}%", diff, counts]) + " |")
    return "\n".join(lines)


def check_prompts(held: dict, checkpoint: str, data) -> None:
    """Stop unless a held-out row's stored prompt is what :func:`rendered` makes of its question: the
    validation rows are then asked as the evaluate stage asks the held-out ones."""
    from pipeline.data.prompts import format_prompt
    from pipeline.data.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(checkpoint) if data.chat_template else None
    if rendered(format_prompt(held["question"], data.prompt_template), tokenizer, data) != held["prompt"]:
        raise SystemExit(f"data/arith_eval.jsonl: {held['id']}'s prompt is not the params' template of its question "
                         "(prepared under other params?)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path,
                   help="the recipe's folder: its params.yaml, data/arith_eval.jsonl and data/arith_train.jsonl")
    p.add_argument("checkpoints", nargs="+", help="NAME=FOLDER, the first the reference")
    p.add_argument("--size", type=int, default=300, help="validation problems asked for")
    p.add_argument("--seed", type=int, default=1, help="seed of the validation draw")
    p.add_argument("--draws", type=int, default=10000)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: model.num_threads)")
    p.add_argument("--fewshot", type=int, default=0, metavar="N",
                   help="ask after the first N worked examples of data/arith_train.jsonl (0: zero-shot)")
    p.add_argument("--out", type=Path,
                   help="also write the table, the seed, the validation rows and every prediction here (JSON)")
    args = p.parse_args(argv)
    if args.fewshot < 0:
        p.error(f"--fewshot is a number of worked examples, 0 or more; got {args.fewshot}")
    pairs = [c.split("=", 1) for c in args.checkpoints]
    if any(len(c) != 2 or not all(c) for c in pairs) or len({c[0] for c in pairs}) != len(pairs):
        p.error("each checkpoint is NAME=FOLDER, with distinct names")
    missing = [folder for _, folder in pairs if not Path(folder).is_dir()]
    if missing:  # before any checkpoint spends minutes scoring
        p.error(f"no checkpoint folder at {', '.join(missing)}")
    from pipeline.core.config_loading import load_config
    from pipeline.core.errors import InputError
    from pipeline.data.schema import read_rows

    d = load_config(args.folder / "params.yaml").data
    try:  # the prepare stage's files, checked row by row
        held_out, train = (read_rows(args.folder / "data" / f"arith_{split}.jsonl") for split in ("eval", "train"))
    except InputError as exc:
        raise SystemExit(str(exc)) from None
    rows = validation_rows(held_out + train, args.size, d.arith_max_level, args.seed, d.prompt_template,
                           d.arith_solution)
    for _, folder in pairs:
        check_prompts(held_out[0], folder, d)
    shots = [(r["question"], r["solution"]) for r in train[:args.fewshot]]
    scored = {name: score(args.folder, Path(folder), rows, args.threads, shots) for name, folder in pairs}
    result = table(rows, scored, args.draws)
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps({**result, "seed": args.seed, "fewshot": args.fewshot, "rows": rows,
                                        "predictions": scored}) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
