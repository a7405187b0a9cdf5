"""Is the SFT start at its plateau?  Held-out accuracy at 80% of the SFT's steps and at its end, on
far more problems than the stage's own check, paired, with 95% intervals.

The SFT stage's own check (``plots/sft.csv``: a greedy pass over the first ``sft.eval_samples`` = 200
held-out problems every ``sft.eval_every`` steps) is too coarse for the criterion "its last 20% of
steps move held-out accuracy by at most 2 points": one problem is 0.5 points, and near 70% accuracy
neighbouring checks of a flat curve differ by about 3 points. For each seed this experiment

1. runs the SFT stage of the given params through the CLI (``sft.seed`` = the seed), with a
   resumable checkpoint at every check from the one nearest 80% of the steps on (``sft.save_every =
   sft.eval_every``; writing them changes no bit of the run, tests/test_sft.py), and copies that
   one, checked by its resume key, as it appears (the stage deletes its resume folder when it ends);
2. scores that checkpoint and the final one greedily, with the stage's own decoding (batch and
   generation budget as the stage's check computes them), on
   - ``held-out``: the stage's own 200 problems. These must reproduce ``plots/sft.csv``'s two figures
     (``reproduces_stage_check``): the check that the kept checkpoint is the one the stage scored;
   - ``fresh``: ``--problems`` new problems of levels 2 to ``data.arith_max_level``, round-robin, none
     of whose expressions is in the training stream or the held-out set (level 1 has 155 distinct
     expressions, all of them used by those two);
3. reports each seed's move (final minus the 80% checkpoint) on each set, with a paired bootstrap
   95% interval over the problems; the move on the held-out set's level mix (its level-1 problems,
   a quarter of it by default, with the held-out set's share of level 1, beside the fresh problems
   of the other levels, which the fresh set holds in equal numbers as the default held-out set
   does); and the mean over seeds with a two-level bootstrap (one problem draw shared by every seed,
   then the seeds), as ``experiments/learning.py`` does (with few seeds, too narrow an interval).

    python experiments/plateau.py --seeds 0 1 2 --work runs/plateau [--problems 2400] [--gsm8k PATH] [--set k=v ...]
    python experiments/plateau.py --work runs/plateau --report        # re-read finished seeds only
    # the stages' and the scoring's CPU kernels are the params' (model.cpu_kernels; native by default)
    # last line: JSON with every figure

Seed 0 of the default params is the committed run's SFT, bit for bit (``checkpoints/sft`` of ``make
run``), so its figures are the default's.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/, experiments/, pipeline/
from bench.common import default_gsm8k, emit  # noqa: E402
from experiments.learning import (add_seed_args, bench_overrides, bootstrap, over_seeds, prepare,  # noqa: E402
                                  run_stage, sft_curve)

from pipeline.core.files import write_bytes_atomic  # noqa: E402
from pipeline.core.lock import workspace_lock  # noqa: E402
from pipeline.data.schema import read_rows

POLL_S = 0.2
FRESH_SEED = "plateau-fresh"


class Keeper:
    """While in its `with` block, copies the checkpoint folder `src` to `dst` as soon as `src` appears
    with resume key `key` (checkpoint folders appear whole: written to a temporary name, then renamed;
    one left by other params or data has another key and is not copied); `dst` appears whole too. An
    error while copying is raised when the block ends."""

    def __init__(self, src: Path, dst: Path, key: str, poll_s: float = POLL_S) -> None:
        self.src, self.dst, self.key, self.poll_s = src, dst, key, poll_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        try:
            while not self.dst.exists():
                if self.src.is_dir() and stored_key(self.src) == self.key:
                    tmp = self.dst.with_name(self.dst.name + ".tmp")
                    shutil.rmtree(tmp, ignore_errors=True)
                    shutil.copytree(self.src, tmp)
                    tmp.rename(self.dst)
                elif self._stop.wait(self.poll_s):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller in __exit__
            self.error = exc

    def __enter__(self) -> Keeper:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc_type is None:
            raise SystemExit(f"copying {self.src} to {self.dst} failed: {self.error}")


def stored_key(folder: Path) -> str | None:
    """The resume key a resumable checkpoint folder was saved under (None if unreadable)."""
    from pipeline.train.manifest import TRAIN_JSON

    try:
        return json.loads((folder / TRAIN_JSON).read_text())["extra"]["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def reference_step(steps: int, eval_every: int) -> int:
    """The check nearest 80% of `steps` (checks fall at multiples of `eval_every`, before the last)."""
    if eval_every < 1:
        raise SystemExit(f"sft.eval_every = {eval_every}: the plateau check needs checks (at least 1)")
    checks = list(range(eval_every, steps, eval_every))
    if not checks:
        raise SystemExit(f"sft.steps = {steps} with sft.eval_every = {eval_every} has no check before the end")
    return min(checks, key=lambda s: abs(s - 0.8 * steps))


def expression_of(question: str) -> str:
    """The expression of a curriculum question ("Compute 7 - 4." -> "7 - 4")."""
    from pipeline.data.arithmetic import PHRASINGS

    for phrasing in PHRASINGS:
        head, tail = phrasing.split("{e}")
        if question.startswith(head) and question.endswith(tail) and len(question) > len(head) + len(tail):
            return question[len(head):len(question) - len(tail)]
    raise ValueError(f"not a curriculum question: {question!r}")


def fresh_rows(used: set[str], n: int, max_level: int, template: str, style: str,
               seed: str = FRESH_SEED) -> list[dict[str, Any]]:
    """`n` problems of levels 2..max_level (round-robin), distinct, none with an expression in `used`."""
    from pipeline.data.arithmetic import sample_problem, to_row

    levels = list(range(2, max_level + 1))
    if not levels:
        raise SystemExit("fresh problems need data.arith_max_level >= 2")
    rng, seen, rows = random.Random(seed), set(used), []
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(10_000):
            p = sample_problem(level, rng)
            if p.expr not in seen:
                break
        else:
            raise SystemExit(f"level {level} has too few unused expressions for {n} fresh problems")
        seen.add(p.expr)
        rows.append(to_row(p, f"arith-fresh-{i:05d}", rng, template, style))
    return rows


def score(folder: Path, cfg, ref: int, n_fresh: int) -> dict[str, Any]:
    """Each set's per-problem greedy correctness of the kept checkpoint and the final one."""
    import torch

    from pipeline.rl.generation import greedy_correct_rows
    from pipeline.stages.sft import check_budget
    from pipeline.train.checkpoint import load_policy

    data = folder / "data"
    held = read_rows(data / "arith_eval.jsonl")[: cfg.sft.eval_samples]
    used = {expression_of(r["question"]) for name in ("arith_train.jsonl", "arith_eval.jsonl")
            for r in read_rows(data / name)}
    fresh = fresh_rows(used, n_fresh, cfg.data.arith_max_level, cfg.data.prompt_template, cfg.data.arith_solution)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"held_out_levels": [r["level"] for r in held], "fresh_levels": [r["level"] for r in fresh]}
    block = cfg.model.block_size
    for name, path in (("ref", folder / "checkpoints" / f"sft_at_{ref}"), ("last", folder / "checkpoints" / "sft")):
        policy = load_policy(path, device="cpu").eval()
        out[name] = {"held_out": greedy_correct_rows(policy, held, check_budget(policy.tokenizer, held, block)),
                     "fresh": greedy_correct_rows(policy, fresh, check_budget(policy.tokenizer, fresh, block))}
    return out


def train_seed(work: Path, params: Path, data: Path, seed: int, overrides: list[str], n_fresh: int) -> dict:
    import contextlib
    import subprocess

    from pipeline.core.config_loading import load_config
    from pipeline.stages.sft import compatibility_key

    folder = work / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    with workspace_lock(f"experiments/plateau.py seed {seed}", root=folder):
        if not (folder / "params.yaml").exists():
            shutil.copy(params, folder / "params.yaml")
        elif (folder / "params.yaml").read_bytes() != params.read_bytes():
            raise SystemExit(f"{folder / 'params.yaml'} differs from {params}: use another --work folder")
        if not (folder / "data").exists():
            (folder / "data").symlink_to(data.resolve())
        cfg = load_config(folder / "params.yaml", [*overrides, f"sft.seed={seed}"])
        if cfg.sft.eval_samples < 1:
            raise SystemExit(f"sft.eval_samples = {cfg.sft.eval_samples}: the plateau check needs held-out problems")
        ref = reference_step(cfg.sft.steps, cfg.sft.eval_every)
        # every check from `ref` on is kept until the stage ends, so `ref` is never rotated away
        keep = len(range(ref, cfg.sft.steps, cfg.sft.eval_every))
        sets = [*overrides, f"sft.seed={seed}", f"sft.save_every={cfg.sft.eval_every}", f"sft.keep_last={keep}"]
        done = folder / "plateau.json"
        if done.is_file():
            result = json.loads(done.read_text())
            if result.get("overrides") != sets or len(result["fresh_levels"]) != n_fresh:
                raise SystemExit(f"{done} was made with other settings ({result.get('overrides')}, "
                                 f"{len(result['fresh_levels'])} fresh problems): use another --work folder")
            return result
        with contextlib.chdir(folder):  # the key hashes data/ as the stage sees it
            key = compatibility_key(load_config(folder / "params.yaml", sets))
        kept, final = folder / "checkpoints" / f"sft_at_{ref}", folder / "checkpoints" / "sft" / "config.json"
        if kept.exists() and stored_key(kept) != key:
            shutil.rmtree(kept)  # from another try with other params: taken again from this run
        wall = None
        if not final.is_file():
            try:
                with Keeper(folder / "checkpoints" / "sft.resume" / f"step_{ref:06d}", kept, key), \
                        open(folder / "sft.log", "a") as log:
                    wall = round(run_stage(folder, "sft", sets, log), 1)
            except subprocess.CalledProcessError as exc:
                raise SystemExit(f"the SFT of seed {seed} failed (exit {exc.returncode}): see {folder / 'sft.log'}")
        if not kept.is_dir():
            raise SystemExit(f"{folder}: no step-{ref} checkpoint of these params was kept (the SFT ended without "
                             f"writing one while this experiment watched); remove {folder / 'checkpoints'} "
                             "and run again")
        result = {"seed": seed, "ref_step": ref, "last_step": cfg.sft.steps, "wall_s": wall,
                  "sft_curve": sft_curve(folder), "overrides": sets, **score(folder, cfg, ref, n_fresh)}
        write_bytes_atomic(done, json.dumps(result).encode())
    return result


def moves(result: dict, which: str) -> list[int]:
    """Per-problem move, final minus the 80% checkpoint: -1, 0 or +1."""
    return [b - a for a, b in zip(result["ref"][which], result["last"][which])]


def mixed_bootstrap(results: list[dict], rng, draws: int = 10_000) -> tuple[float, float, float]:
    """(mean, 95% low, 95% high) of the move on the held-out set's level mix: level 1 from the held-out
    problems (the fresh set has none), the other levels from the fresh problems, weighted by the
    held-out set's share of level 1. Each stratum's problems resampled once per draw, the same draw for
    every seed (the seeds are scored on the same problems, as in `experiments/learning.py`'s `bootstrap`),
    then the seeds."""
    import numpy as np

    def strata(r: dict) -> tuple[float, np.ndarray, np.ndarray]:
        w1 = sum(L == 1 for L in r["held_out_levels"]) / len(r["held_out_levels"])
        one = np.asarray([d for d, L in zip(moves(r, "held_out"), r["held_out_levels"]) if L == 1] or [0], float)
        return w1, one, np.asarray(moves(r, "fresh"), float)

    parts = [strata(r) for r in results]
    shapes = {(w1, len(one), len(rest)) for w1, one, rest in parts}
    if len(shapes) != 1:
        raise ValueError(f"seeds scored on different problem sets (level-1 share, level-1 and fresh counts: "
                         f"{sorted(shapes)}); a mean over seeds needs the same problems for every seed")
    _, n_one, n_rest = shapes.pop()
    one_draw = rng.integers(0, n_one, (draws, n_one))
    rest_draw = rng.integers(0, n_rest, (draws, n_rest))
    points = [w1 * one.mean() + (1 - w1) * rest.mean() for w1, one, rest in parts]
    boots = np.stack([w1 * one[one_draw].mean(axis=1) + (1 - w1) * rest[rest_draw].mean(axis=1)
                      for w1, one, rest in parts])  # (seeds, draws): each seed on each problem draw
    return (float(np.mean(points)), *over_seeds(boots, rng))


def report(results: list[dict]) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    table: dict[str, Any] = {"seeds": [r["seed"] for r in results], "per_seed": []}
    pct = lambda m, lo, hi: f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"  # noqa: E731
    print(f"{len(results)} seeds ({', '.join(str(r['seed']) for r in results)}); move = final - the "
          f"checkpoint at the check nearest 80% of the steps, points [95% paired interval over the problems]")
    for r in results:
        curve = dict(r["sft_curve"])
        n = len(r["ref"]["held_out"])
        stage = [curve.get(r["ref_step"]), curve.get(r["last_step"])]
        row = {"seed": r["seed"], "ref_step": r["ref_step"], "last_step": r["last_step"], "stage_check": stage,
               # the kept checkpoint is the one the stage scored: the same number of held-out problems right
               "reproduces_stage_check": [None if a is None else round(a * n) for a in stage]
               == [sum(r["ref"]["held_out"]), sum(r["last"]["held_out"])]}
        for which in ("held_out", "fresh"):
            ms = moves(r, which)
            m, lo, hi = bootstrap([ms], rng)
            row[which] = {"n": len(ms), "ref": round(float(np.mean(r["ref"][which])), 4),
                          "last": round(float(np.mean(r["last"][which])), 4),
                          "move": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)],
                          "up_down": [sum(x > 0 for x in ms), sum(x < 0 for x in ms)]}
        levels = r["fresh_levels"]
        row["fresh_by_level"] = {
            str(lv): round(float(np.mean([d for d, L in zip(moves(r, "fresh"), levels) if L == lv])), 4)
            for lv in sorted(set(levels))}
        m, lo, hi = mixed_bootstrap([r], rng)
        row["held_out_mix"] = {"move": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)]}
        table["per_seed"].append(row)
        h, f = row["held_out"], row["fresh"]
        same = "as in plots/sft.csv" if row["reproduces_stage_check"] else f"NOT plots/sft.csv's {stage}"
        print(f"  seed {r['seed']}: steps {r['ref_step']} -> {r['last_step']}")
        print(f"    held-out ({h['n']}): {100 * h['ref']:.1f}% -> {100 * h['last']:.1f}%  move "
              f"{pct(h['move'], *h['ci95'])}  ({same})")
        print(f"    fresh ({f['n']}, levels {min(levels)}-{max(levels)}): {100 * f['ref']:.1f}% -> "
              f"{100 * f['last']:.1f}%  move {pct(f['move'], *f['ci95'])}; problems up / down {f['up_down']}; by level "
              f"{', '.join(f'{k}: {100 * v:+.1f}' for k, v in row['fresh_by_level'].items())}")
        print(f"    on the held-out set's level mix (its level 1, the fresh set's others): "
              f"{pct(row['held_out_mix']['move'], *row['held_out_mix']['ci95'])}")
    for which in ("held_out", "fresh"):
        m, lo, hi = bootstrap([moves(r, which) for r in results], rng)
        table[f"mean_{which}"] = {"move": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)]}
    m, lo, hi = mixed_bootstrap(results, rng)
    table["mean_held_out_mix"] = {"move": round(m, 4), "ci95": [round(lo, 4), round(hi, 4)]}
    few = " (seeds, then problems, resampled: with few seeds too narrow an interval)" if len(results) > 1 else ""
    print(f"  mean move over seeds{few}:")
    for which in ("held_out", "fresh", "held_out_mix"):
        t = table[f"mean_{which}"]
        print(f"    {which:12s} {pct(t['move'], *t['ci95'])}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_args(ap, work_required=True)
    ap.add_argument("--problems", type=int, default=2400, help="fresh problems (levels 2..max, round-robin)")
    args = ap.parse_args()
    if args.problems < 1:
        ap.error("--problems must be at least 1")
    overrides = bench_overrides(args)
    work = args.work.resolve()
    if args.report:
        results = [json.loads(p.read_text()) for p in sorted(work.glob("seed-*/plateau.json"))]
        if not results:
            raise SystemExit(f"no finished seed under {work}")
        for r in results:  # files written before the held-out levels were stored
            if "held_out_levels" not in r:
                held = read_rows(work / "prepared" / "data" / "arith_eval.jsonl")[: len(r["ref"]["held_out"])]
                r["held_out_levels"] = [h["level"] for h in held]
    else:
        data = prepare(work, args.params, args.gsm8k or default_gsm8k(), overrides)
        results = [train_seed(work, args.params, data, s, overrides, args.problems) for s in args.seeds]
    table = report(results)
    table["wall_s"] = {r["seed"]: r["wall_s"] for r in results}
    emit(table)


if __name__ == "__main__":
    main()
