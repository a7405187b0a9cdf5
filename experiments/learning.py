"""Does GRPO beat its equal-compute SFT control?  Held-out arithmetic accuracy of the sft, control
and warmup checkpoints over several seeds, with 95% intervals over the held-out problems and the seeds.

For each seed s it runs the stages ``sft``, then ``warmup`` and ``control`` side by side (as the
pipeline's flow does), of the given params (each stage's own seed set to s; threads as the params
say), in its own working folder under ``--work``, all sharing one prepared ``data/``, ``--jobs``
seeds at a time (a re-run keeps the stages that finished; each stage's wall time is reported, so
run one seed at a time on a 2-core machine for the pipeline's own timings); then scores every checkpoint
greedily on the held-out set (``data/arith_eval.jsonl``) exactly as the evaluate stage does (its batch
size, generation budget and verifier), so seed 0 of the default params gives metrics/eval.json's figures.

Reported, per checkpoint: the mean accuracy over seeds with a 95% interval from a two-level
bootstrap (seeds resampled, then problems), each seed's figure, and the SFT's plateau check (how
much held-out accuracy moved over its last 20% of steps, from ``plots/sft.csv``). Then the paired
difference warmup - control (the same seed's checkpoints on the same problems) with its interval,
and the same figures per curriculum level of the held-out problems (where the prepared data is there).

    python experiments/learning.py --seeds 0 1 2 --work runs/learning [--gsm8k PATH] [--jobs 1] [--set k=v ...]
    python experiments/learning.py --work runs/learning --report      # re-read finished seeds only
    python experiments/learning.py --work runs/learning --report --rescore   # ... scoring their checkpoints again
    python experiments/learning.py --run .          # a finished pipeline run (its evaluate stage's reports/)
    python experiments/learning.py --work runs/learning --report --run .   # the seeds and the run in one table
    python experiments/learning.py --work runs/new --report --against runs/learning  # per checkpoint, new - old, paired
    python experiments/learning.py --seeds 0 1 --work runs/learning --sft-from runs/plateau [--set k=v ...]
        # each seed's SFT taken from experiments/plateau.py's work folder (checked to be this run's SFT), not trained
    # the stages' and the scoring's CPU kernels are the params' (model.cpu_kernels; native by default)
    # last line: JSON with every figure
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/, pipeline/
from bench.common import ROOT, default_gsm8k, machine_line  # noqa: E402

from pipeline.core.files import write_bytes_atomic  # noqa: E402
from pipeline.core.lock import workspace_lock  # noqa: E402

STAGES = ("sft", "control", "warmup")  # in the table's order
SIDE_BY_SIDE = ("warmup", "control")  # after the sft, run at once (the pipeline's graph)
BOOTSTRAP = 10_000


def run_stage(folder: Path, stage: str, overrides: list[str], log) -> float:
    """Run one stage through the CLI in `folder`; its wall seconds."""
    cmd = [sys.executable, "-m", "pipeline", stage, "--params", str(folder / "params.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=folder, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    return time.monotonic() - t0


def prepare(work: Path, params: Path, gsm8k: str, overrides: list[str]) -> Path:
    base = work / "prepared"
    if not (base / "data" / "stats.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        shutil.copy(params, base / "params.yaml")
        with open(base / "prepare.log", "w") as log:
            run_stage(base, "prepare", [f"data.gsm8k_source={gsm8k}", *overrides], log)
    return base / "data"


SEEDED = ("sft", "warmup", "control")  # the training stages whose own seed makes a run's seed


def seed_sets(seed: int) -> list[str]:
    """The overrides that make a run seed `seed`: each training stage's own seed."""
    return [f"{stage}.seed={seed}" for stage in SEEDED]


# SFT settings that change no bit of its run (tests/test_sft.py): when resumable checkpoints are written
# and how many are kept. experiments/plateau.py sets both; any value stands for all here.
BITLESS_SFT = {"save_every": 1, "keep_last": 1}


def sft_key(folder: Path, overrides: list[str]) -> str:
    """The SFT stage's own resume key (:func:`pipeline.stages.sft.compatibility_key`: its params, the
    model's, and the data files it reads) for `folder`'s params.yaml and data/ with `overrides`, the
    :data:`BITLESS_SFT` settings set aside: two folders with the same key train the same SFT."""
    import contextlib
    import dataclasses

    from pipeline.core.config_loading import load_config
    from pipeline.stages.sft import compatibility_key

    cfg = load_config(folder / "params.yaml", overrides)
    cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, **BITLESS_SFT))
    with contextlib.chdir(folder):  # the key hashes data/ as the stage sees it
        return compatibility_key(cfg)


def adopt_sft(source: Path, folder: Path, sets: list[str]) -> None:
    """Take a seed's SFT (``checkpoints/sft`` and ``plots/sft.csv``) from `source`, the same seed's
    folder of a finished ``experiments/plateau.py`` run, after checking that it is the SFT this seed's stage
    would train (:func:`sft_key` of its recorded overrides against `sets`). The checkpoint appears
    atomically, last, so a seed folder with it has its SFT whole."""
    done, ckpt = source / "plateau.json", source / "checkpoints" / "sft"
    if not done.is_file() or not (ckpt / "config.json").is_file():
        raise SystemExit(f"{source}: no finished SFT there (run experiments/plateau.py for this seed first)")
    theirs = json.loads(done.read_text())["overrides"]
    if sft_key(source, theirs) != sft_key(folder, sets):
        raise SystemExit(f"{source}: its SFT ran with other params or data than this seed's (its overrides: "
                         f"{' '.join(theirs)}; here: {' '.join(sets)}); pass the same --params and --set")
    (folder / "plots").mkdir(exist_ok=True)
    write_bytes_atomic(folder / "plots" / "sft.csv", (source / "plots" / "sft.csv").read_bytes())
    tmp = folder / "checkpoints" / ".sft.adopting"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    os.replace(tmp, folder / "checkpoints" / "sft")


def train_seed(work: Path, params: Path, data: Path, seed: int, overrides: list[str],
               sft_from: Path | None = None) -> dict:
    folder = work / f"seed-{seed}"
    done = folder / "scores.json"
    if done.is_file():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(params, folder / "params.yaml")
    if not (folder / "data").exists():
        (folder / "data").symlink_to(data.resolve())
    sets = [*overrides, *seed_sets(seed)]
    wall = {}

    def stage(name: str) -> None:  # a stage whose checkpoint exists finished (checkpoints appear atomically)
        if not (folder / "checkpoints" / name / "config.json").is_file():
            with open(folder / f"{name}.log", "a") as log:
                wall[name] = round(run_stage(folder, name, sets, log), 1)

    # the seed's folder is one workspace: this process holds its lock and the stages pass through it
    # (pipeline.core.lock), so warmup and control can run side by side, one core each, as the flow runs them
    with workspace_lock(f"experiments/learning.py seed {seed}", root=folder):
        if sft_from is not None and not (folder / "checkpoints" / "sft" / "config.json").is_file():
            adopt_sft(sft_from / f"seed-{seed}", folder, sets)
        stage("sft")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(stage, name) for name in SIDE_BY_SIDE]:
                f.result()
    result = {"seed": seed, "wall_s": wall, "correct": score(folder, sets), "sft_curve": sft_curve(folder),
              "overrides": sets, **({"sft_from": str(sft_from)} if sft_from is not None else {})}
    write_bytes_atomic(done, json.dumps(result).encode())
    return result


def greedy_predictions(folder: Path, overrides: list[str]) -> dict[str, list[dict]]:
    """Each checkpoint's prediction rows on the held-out problems, in file order: the evaluate stage's
    own greedy pass (:func:`pipeline.stages.evaluate.evaluate_task`: its `evaluate.batch_size`,
    `evaluate.max_new_tokens` and verifier), so a seed's figures are the ones its pipeline run puts in
    metrics/eval.json."""
    import torch

    from pipeline.core.config_loading import load_config
    from pipeline.data.tasks import task_files
    from pipeline.stages.evaluate import evaluate_task, load_rows
    from pipeline.train.checkpoint import load_policy

    cfg = load_config(folder / "params.yaml", overrides)
    torch.set_num_threads(1)
    rows = load_rows(folder / "data" / task_files("arith").test, cfg.evaluate.arith_limit)
    out = {}
    for stage in STAGES:
        policy = load_policy(folder / "checkpoints" / stage, device="cpu")
        policy.eval()
        out[stage] = evaluate_task(policy, rows, cfg, samples=0)
    return out


def score(folder: Path, overrides: list[str]) -> dict[str, list[int]]:
    """Greedy correctness (0/1) of each checkpoint on every held-out problem, in file order."""
    return {stage: [int(p["correct"]) for p in preds]
            for stage, preds in greedy_predictions(folder, overrides).items()}


def scored_run(folder: Path) -> dict:
    """One finished pipeline run as a seed's result: the evaluate stage's greedy correctness per
    held-out problem (``reports/predictions_<stage>_arith.csv``: the same verifier as :func:`score`,
    with the stage's own generation budget) and the SFT curve (``plots/sft.csv``); no wall times."""
    out = {}
    for stage in STAGES:
        with open(folder / "reports" / f"predictions_{stage}_arith.csv") as f:
            out[stage] = [int(r["correct"] in ("True", "1", "true")) for r in csv.DictReader(f)]
    return {"seed": "run", "correct": out, "sft_curve": sft_curve(folder), "wall_s": {},
            "stage_seeds": run_seeds(folder)}


def run_seeds(folder: Path) -> list[int] | None:
    """The seeds of a pipeline run's training stages (:data:`SEEDED`), as its ``params.yaml`` sets them
    (defaults included); None where that file is missing or not valid params."""
    from pipeline.core.config_loading import load_config

    try:
        cfg = load_config(folder / "params.yaml")
    except (OSError, ValueError):  # InputError is a ValueError
        return None
    return [getattr(cfg, stage).seed for stage in SEEDED]


def counted_twice(seeds: list[dict], run: dict) -> int | None:
    """The seed under --work whose stage seeds the run also has (the same seed counted twice), or None."""
    if run.get("stage_seeds") is None:
        return None
    return next((r["seed"] for r in seeds if run["stage_seeds"] == [r["seed"]] * len(run["stage_seeds"])), None)


def sft_curve(folder: Path) -> list[tuple[int, float]]:
    with open(folder / "plots" / "sft.csv") as f:
        return [(int(r["step"]), float(r["arith_accuracy"])) for r in csv.DictReader(f) if r.get("arith_accuracy")]


def plateau_move(curve: list[tuple[int, float]]) -> float | None:
    """Held-out accuracy at the last check minus at the check nearest 80% of the steps."""
    if len(curve) < 2:
        return None
    last_step, last = curve[-1]
    ref = min(curve[:-1], key=lambda c: abs(c[0] - 0.8 * last_step))
    return round(last - ref[1], 4)


def bootstrap(per_seed: list[list[float]], rng, draws: int = BOOTSTRAP) -> tuple[float, float, float]:
    """(mean, 95% low, 95% high) of the mean over seeds of the mean over problems; seeds and then
    problems resampled with replacement (the same problem draw for every seed: they share the set).
    `rng`: a numpy Generator; `draws`: bootstrap resamples."""
    import numpy as np

    arr = np.asarray(per_seed, dtype=float)  # (seeds, problems)
    n = arr.shape[1]
    problems = rng.integers(0, n, size=(draws, n))
    return (float(arr.mean()), *over_seeds(arr[:, problems].mean(axis=2), rng))


def over_seeds(means, rng) -> tuple[float, float]:
    """95% (low, high) of the mean over seeds, from `means` (seeds, draws): each seed's statistic on
    each problem draw (one draw shared by every seed); the seeds resampled with replacement per draw."""
    import numpy as np

    n_seeds, draws = means.shape
    seeds = rng.integers(0, n_seeds, size=(draws, n_seeds))
    stats = np.sort(means[seeds, np.arange(draws)[:, None]].mean(axis=1))
    return float(stats[int(0.025 * draws)]), float(stats[int(0.975 * draws) - 1])


def held_out_levels(data: Path) -> list[int] | None:
    """The curriculum level of each held-out problem (the evaluate stage's arithmetic file under the
    prepared `data`, read as it reads it), in file order; None where the file is missing."""
    from pipeline.data.schema import read_rows
    from pipeline.data.tasks import task_files

    path = data / task_files("arith").test
    return [int(row["level"]) for row in read_rows(path)] if path.is_file() else None


def per_level(results: list[dict], levels: list[int], rng) -> dict:
    """Each level's share of the table: every checkpoint's accuracy (mean over seeds) and the paired
    warmup - control difference with its two-level bootstrap interval, over that level's problems only
    (the first len(correct) rows of `levels`: the scoring's `evaluate.arith_limit` takes the file's head)."""
    n = len(results[0]["correct"]["sft"])
    if len(levels) < n:
        raise SystemExit(f"the held-out file has {len(levels)} problems, the scores {n}: not the set they were scored on")
    out = {}
    for level in sorted(set(levels[:n])):
        idx = [i for i in range(n) if levels[i] == level]
        row = {"problems": len(idx)}
        for stage in STAGES:
            row[stage] = round(sum(r["correct"][stage][i] for r in results for i in idx) / (len(idx) * len(results)), 4)
        diffs = [[r["correct"]["warmup"][i] - r["correct"]["control"][i] for i in idx] for r in results]
        mean, low, high = bootstrap(diffs, rng)
        row["warmup_minus_control"] = {"mean": round(mean, 4), "ci95": [round(low, 4), round(high, 4)]}
        out[level] = row
    return out


def report(results: list[dict], levels: list[int] | None = None) -> dict:
    """The table over seeds (and, with the held-out problems' `levels`, per level), printed; as a dict."""
    import numpy as np

    sizes = {len(r["correct"][s]) for r in results for s in STAGES}
    if len(sizes) != 1:
        raise SystemExit(f"the runs were scored on different held-out sets ({sorted(sizes)} problems): "
                         "pair only runs of the same prepared data")

    rng = np.random.default_rng(0)
    table = {}
    for stage in STAGES:
        per_seed = [r["correct"][stage] for r in results]
        mean, low, high = bootstrap(per_seed, rng)
        table[stage] = {"mean": round(mean, 4), "ci95": [round(low, 4), round(high, 4)],
                        "seeds": [round(sum(s) / len(s), 4) for s in per_seed]}
    diffs = [[w - c for w, c in zip(r["correct"]["warmup"], r["correct"]["control"])] for r in results]
    mean, low, high = bootstrap(diffs, rng)
    table["warmup_minus_control"] = {"mean": round(mean, 4), "ci95": [round(low, 4), round(high, 4)],
                                     "seeds": [round(sum(d) / len(d), 4) for d in diffs]}
    # discordant problems of each seed: (solved by the warmup only, by the control only)
    table["discordant"] = [[sum(d > 0 for d in ds), sum(d < 0 for d in ds)] for ds in diffs]
    table["sft_plateau_move"] = [plateau_move(r["sft_curve"]) for r in results]
    table["wall_s"] = {r["seed"]: r["wall_s"] for r in results}
    print(f"{len(results)} seeds ({', '.join(str(r['seed']) for r in results)}), "
          f"{len(results[0]['correct']['sft'])} held-out problems; greedy accuracy, mean over seeds [95% interval]")
    for stage in (*STAGES, "warmup_minus_control"):
        t = table[stage]
        print(f"  {stage:22s} {100 * t['mean']:6.1f}%  [{100 * t['ci95'][0]:5.1f}, {100 * t['ci95'][1]:5.1f}]  "
              f"seeds: {' / '.join(f'{100 * s:.1f}' for s in t['seeds'])}")
    print(f"  problems only the warmup / only the control solves, per seed: {table['discordant']}")
    print(f"  SFT accuracy moved over its last 20% of steps: {table['sft_plateau_move']}")
    if levels is not None:
        table["per_level"] = per_level(results, levels, rng)
        for level, row in table["per_level"].items():
            d = row["warmup_minus_control"]
            print(f"  level {level} ({row['problems']} problems): "
                  + " / ".join(f"{stage} {100 * row[stage]:.1f}%" for stage in STAGES)
                  + f"; warmup - control {100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]")
    for seed, wall in table["wall_s"].items():
        if wall:
            print(f"  seed {seed} stage wall s: {wall}")
    return table


def against(results: list[dict], others: list[dict], rng) -> dict:
    """Each checkpoint's paired difference between two recipes over the seeds both ran (this one's
    `results` minus `others`, the same seed's checkpoint on the same problems), with its two-level
    bootstrap interval: how much a change moved each checkpoint, not only the lead."""
    theirs = {r["seed"]: r for r in others}
    common = [r for r in results if r["seed"] in theirs]
    if not common:
        raise SystemExit(f"--against: no seed there ran here too (here: {[r['seed'] for r in results]}, there: "
                         f"{sorted(theirs)}); pair runs of the same seeds")
    sizes = {len(r["correct"][s]) for r in (*common, *(theirs[r["seed"]] for r in common)) for s in STAGES}
    if len(sizes) != 1:
        raise SystemExit(f"--against: the runs were scored on different held-out sets ({sorted(sizes)} problems): "
                         "pair only runs of the same prepared data")
    out = {"seeds": [r["seed"] for r in common]}
    for stage in STAGES:
        diffs = [[a - b for a, b in zip(r["correct"][stage], theirs[r["seed"]]["correct"][stage])] for r in common]
        mean, low, high = bootstrap(diffs, rng)
        out[stage] = {"mean": round(mean, 4), "ci95": [round(low, 4), round(high, 4)],
                      "seeds": [round(sum(d) / len(d), 4) for d in diffs]}
    return out


def print_against(table: dict, other: Path) -> None:
    print(f"  minus {other} (seeds {', '.join(str(s) for s in table['seeds'])}), paired:")
    for stage in STAGES:
        t = table[stage]
        print(f"    {stage:20s} {100 * t['mean']:+6.1f}  [{100 * t['ci95'][0]:+5.1f}, {100 * t['ci95'][1]:+5.1f}]  "
              f"seeds: {' / '.join(f'{100 * s:+.1f}' for s in t['seeds'])}")


def add_seed_args(ap: argparse.ArgumentParser, work_required: bool) -> None:
    """The flags of an experiment that trains seeds in a working folder (this one, experiments/plateau.py)."""
    ap.add_argument("--work", type=Path, required=work_required,
                    help="working folder (kept: finished seeds are reused)")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--gsm8k", default=None, help="local GSM8K folder (default: $GSM8K, else datasets/gsm8k)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--report", action="store_true", help="only report the seeds already finished")


def bench_overrides(args: argparse.Namespace) -> list[str]:
    """The stages' overrides (no tracking, one thread per process, then the user's `--set`s), with this
    process's CPU kernels pinned as the stages' CLI pins them (`model.cpu_kernels`), so the experiment's
    own scoring computes as the stages do; a bad param or a pin this CPU lacks exits with its one line."""
    from pipeline.core.cli import exit_status
    from pipeline.core.config_loading import load_config
    from pipeline.core.kernels import apply as pin_cpu_kernels

    overrides = ["tracking.enabled=false", "model.num_threads=1", *args.overrides]

    def pin() -> int:
        pin_cpu_kernels(load_config(args.params, overrides).model.cpu_kernels)
        return 0

    code = exit_status(pin)
    if code:
        sys.exit(code)
    print(machine_line(1))
    return overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_args(ap, work_required=False)
    ap.add_argument("--jobs", type=int, default=1, help="seeds at a time")
    ap.add_argument("--rescore", action="store_true",
                    help="with --report: score the finished seeds' checkpoints again (and keep the new scores)")
    ap.add_argument("--run", type=Path, default=None,
                    help="report one finished pipeline run (a folder with the evaluate stage's reports/ and "
                         "plots/sft.csv, e.g. the repo after `make run`): the paired warmup - control interval "
                         "over its held-out problems; with --report, as one more seed beside those under --work")
    ap.add_argument("--against", type=Path, default=None,
                    help="with --report: another --work folder of the same seeds (e.g. the recipe before a change); "
                         "also prints each checkpoint's paired difference, this folder's minus that one's")
    ap.add_argument("--sft-from", type=Path, default=None,
                    help="a experiments/plateau.py --work folder: each seed's SFT is taken from its seed-N there "
                         "(refused unless it is this run's SFT: the same params, overrides and data), not trained")
    args = ap.parse_args()
    if args.run is None and args.work is None:
        ap.error("--work is required (or --run)")
    if args.report and args.work is None:
        ap.error("--report reads the seeds under --work")
    if args.rescore and not args.report:
        ap.error("--rescore goes with --report (it scores the finished seeds under --work again)")
    if args.against is not None and (not args.report or args.rescore):
        ap.error("--against goes with --report, without --rescore (it compares the scores already under two "
                 "--work folders)")
    if args.sft_from is not None and (args.report or args.run is not None):
        ap.error("--sft-from goes with training seeds (not with --report or --run)")
    overrides = bench_overrides(args)
    levels = None
    if args.run is not None and not args.report:
        results = [scored_run(args.run)]
        levels = held_out_levels(args.run / "data")
    elif args.report:
        args.work = args.work.resolve()
        results = [json.loads(p.read_text()) for p in sorted(args.work.glob("seed-*/scores.json"))]
        if args.rescore:
            for r in results:
                folder = args.work / f"seed-{r['seed']}"
                r["correct"] = score(folder, r.get("overrides") or [*overrides, *seed_sets(r["seed"])])
                write_bytes_atomic(folder / "scores.json", json.dumps(r).encode())
        if args.run is not None:  # a pipeline run beside the seeds (its own seed: the params')
            run = scored_run(args.run)
            twice = counted_twice(results, run)
            if twice is not None:
                raise SystemExit(f"{args.run / 'params.yaml'}: the run's seeds are those of seed-{twice} under "
                                 f"{args.work}; one seed would count twice in the mean (leave out --run or that seed)")
            results.append(run)
        levels = held_out_levels(args.work / "prepared" / "data")
    else:
        args.work = args.work.resolve()  # the stages run with their seed's folder as working directory
        data = prepare(args.work, args.params, args.gsm8k or default_gsm8k(), overrides)
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            sft_from = args.sft_from.resolve() if args.sft_from is not None else None
            futures = [pool.submit(train_seed, args.work, args.params, data, s, overrides, sft_from)
                       for s in args.seeds]
            results = [f.result() for f in futures]
        levels = held_out_levels(data)
    if not results:
        raise SystemExit(f"no finished seed under {args.work or args.run}")
    table = report(sorted(results, key=lambda r: (isinstance(r["seed"], str), r["seed"])), levels)  # seeds in order, then a run
    if args.against is not None:
        import numpy as np

        from pipeline.data.tasks import task_files

        held_out = [w / "prepared" / "data" / task_files("arith").test for w in (args.work, args.against)]
        if len({p.read_bytes() if p.is_file() else None for p in held_out}) != 1:
            raise SystemExit(f"--against: {held_out[0]} and {held_out[1]} differ (or one is missing): pair only "
                             "runs of the same prepared data")
        others = [json.loads(p.read_text()) for p in sorted(args.against.glob("seed-*/scores.json"))]
        table["against"] = {"work": str(args.against), **against(results, others, np.random.default_rng(0))}
        print_against(table["against"], args.against)
    print(json.dumps({"overrides": args.overrides, **table}))


if __name__ == "__main__":
    main()
