"""The SFT step on a CPU's cores: one process of C threads against `--nproc` processes (torchrun, gloo)
of C / nproc threads each (`sft.nproc`), on the params' own SFT workload.

In a temp working dir: the prepare stage on the local GSM8K copy. Then, alternating, each arm in a
fresh process (or process group): ``pipeline.stages.sft.setup(cfg, "sft")`` (the seeded model and
batch order of the stage), ``--warm-steps`` untimed steps, ``--steps`` timed ``sft_step`` calls (the
gradient sum over ranks included) and one held-out check (``held_out``: validation loss and greedy
accuracy, split across ranks). Nothing is written. Startup (imports, torchrun, data encoding) is
not timed: over a 4,500-step stage it is noise.

Figures: seconds per step and per check of each arm, each round's ratio one process / several
processes (the rounds run back to back, so load that drifts between rounds hits both arms alike),
min / median / max over the rounds.

    .venv/bin/python bench/sft_ddp.py [--params params.yaml] [--gsm8k PATH] [--cores 2] [--nproc 2]
        [--steps 60] [--warm-steps 10] [--repeats 3] [--set sft.batch_size=32 ...]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, default_gsm8k, emit, fmt_ratios, machine_line, median, pair_ratios, workdir

WORKER_TAG = "SFT_DDP_RESULT "


def worker(args: argparse.Namespace) -> None:
    """One arm, in this process (or this torchrun rank): time `sft_step` and one held-out check."""
    import torch

    from pipeline.core import distributed as du
    from pipeline.core.config_loading import load_config
    from pipeline.stages import sft

    world = du.world_size()
    threads = max(1, args.cores // world)
    torch.set_num_threads(threads)
    cfg = load_config(args.params, [*args.set, f"sft.nproc={world}", f"sft.num_threads={threads}",
                                    "tracking.enabled=false"])
    run = sft.setup(cfg, "sft")
    state = sft.SFTState()
    for _ in range(args.warm_steps):
        state.step += 1
        sft.sft_step(run, state)
    du.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state.step += 1
        sft.sft_step(run, state)
    step_s = (time.perf_counter() - t0) / args.steps
    du.barrier()
    t0 = time.perf_counter()
    sft.held_out(run)
    check_s = time.perf_counter() - t0
    if du.rank() == 0:
        print(WORKER_TAG + json.dumps({"world": world, "threads": threads, "step_s": step_s, "check_s": check_s}),
              flush=True)


def run_arm(args: argparse.Namespace, nproc: int, cwd: Path) -> dict:
    me = [str(Path(__file__).resolve()), "--worker", "--params", str(args.params), "--cores", str(args.cores),
          "--steps", str(args.steps), "--warm-steps", str(args.warm_steps), *[x for s in args.set for x in ("--set", s)]]
    cmd = [sys.executable, *me] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me]
    threads = str(max(1, args.cores // nproc))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(WORKER_TAG)]
    if res.returncode or not lines:
        raise SystemExit(f"arm nproc={nproc} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return json.loads(lines[-1][len(WORKER_TAG):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--gsm8k", default=None, help="local GSM8K copy (default: $GSM8K, else datasets/gsm8k)")
    ap.add_argument("--cores", type=int, default=2, help="cores both arms fill (threads x processes)")
    ap.add_argument("--nproc", type=int, default=2, help="processes of the DDP arm")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per arm and round")
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each runs both arms")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (repeatable)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.params = args.params.resolve()
    if args.worker:
        worker(args)
        return
    gsm8k = str(Path(args.gsm8k).resolve()) if args.gsm8k else default_gsm8k()
    print(machine_line(args.cores))
    with workdir() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(args.params),
                        "--set", f"data.gsm8k_source={gsm8k}", "--set", "tracking.enabled=false"],
                       cwd=tmp, env=env, check=True, capture_output=True)
        arms = {"one": 1, "ddp": args.nproc}
        results: dict[str, list[dict]] = {k: [] for k in arms}
        for r in range(args.repeats):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]  # alternate which arm goes first
            for name in order:
                results[name].append(run_arm(args, arms[name], tmp))
            print(f"round {r + 1}: " + ", ".join(
                f"{k} {results[k][-1]['step_s'] * 1e3:.0f} ms/step, check {results[k][-1]['check_s']:.1f} s"
                for k in arms), flush=True)
    steps = {k: [x["step_s"] for x in v] for k, v in results.items()}
    checks = {k: [x["check_s"] for x in v] for k, v in results.items()}
    step_ratio, check_ratio = pair_ratios(steps, "one", "ddp"), pair_ratios(checks, "one", "ddp")
    print(f"1 process x {args.cores} threads: {median(steps['one']) * 1e3:.0f} ms/step, "
          f"check {median(checks['one']):.1f} s")
    print(f"{args.nproc} processes x {max(1, args.cores // args.nproc)} thread(s): "
          f"{median(steps['ddp']) * 1e3:.0f} ms/step, check {median(checks['ddp']):.1f} s")
    print(f"per step: {fmt_ratios(step_ratio)}; per held-out check: {fmt_ratios(check_ratio)}; load now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    emit({"bench": "sft_ddp", "cores": args.cores, "nproc": args.nproc, "steps": args.steps,
          "step_s": steps, "check_s": checks, "step_speedup": step_ratio, "check_speedup": check_ratio})


if __name__ == "__main__":
    main()
