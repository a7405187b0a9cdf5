"""Peak memory of each stage of the default run: RSS (CPU) and, on GPU, CUDA max allocated.

Each stage runs as ``python -m pipeline STAGE`` in its own subprocess, in order, in a temp working
dir, on the default params (``--params``) with the local GSM8K copy; the peak RSS of that process
comes from ``os.wait4`` (its own ``ru_maxrss``, not the running maximum over all children). On CUDA
the child also prints ``torch.cuda.max_memory_allocated()``.

Shapes are the default run's (model, batch sizes, group size, rollout length, evaluation batch and
max_new_tokens), but iteration counts are cut so it finishes in minutes (peak memory is reached in
the first steps; evaluation limits cut the number of batches, not their size):
sft.steps 20, warmup/grpo.iterations 2 (with one held-out check of 16 problems each),
evaluate.gsm8k_limit/arith_limit 64 (one full batch of 64 each), tracking off. Override with --set.

    .venv/bin/python bench/memory.py [--params params.yaml] [--gsm8k PATH] [--set KEY=VALUE ...]

``--estimate`` (the default for an hf-backend params file such as configs/instruct.yaml, whose
model a measurement would have to download) runs nothing: it prints the estimated peak GPU memory
of each GRPO phase for a model size (``--size``, or ``--hf-config`` a local model folder) and
whether it fits one 80 GB / 141 GB card; see bench/memory_estimate.py for what is counted.

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
from common import ROOT, default_gsm8k, emit, load_avg, workdir

from memory_estimate import SIZES, report, shape_from_hf_config

from pipeline.core.config import STAGES
from pipeline.core.config_loading import load_config

REDUCED = ["sft.steps=20", "sft.eval_every=20", "warmup.iterations=2", "grpo.iterations=2", "warmup.eval_every=2",
           "grpo.eval_every=2", "warmup.eval_samples=16", "grpo.eval_samples=16", "evaluate.gsm8k_limit=64",
           "evaluate.arith_limit=64", "tracking.enabled=false"]
CHILD = """
import json, sys, torch
from pipeline.__main__ import main
rc = main(sys.argv[1:])
if torch.cuda.is_available():
    print("CUDA_PEAK " + json.dumps({"max_allocated": torch.cuda.max_memory_allocated(),
                                     "max_reserved": torch.cuda.max_memory_reserved()}))
sys.exit(rc)
"""


def run_stage(stage: str, params: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-c", CHILD, stage, "--params", params, *[x for o in overrides for x in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{stage} failed ({proc.returncode}):\n{out[-3000:]}")
    res = {"stage": stage, "seconds": round(secs, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}
    for line in out.splitlines():
        if line.startswith("CUDA_PEAK "):
            cuda = json.loads(line[len("CUDA_PEAK "):])
            res.update({f"cuda_{k}_mb": round(v / 2 ** 20, 1) for k, v in cuda.items()})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--gsm8k", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--full", action="store_true", help="the default iteration counts (hours on CPU)")
    ap.add_argument("--estimate", action="store_true", help="estimate GPU memory per phase, run nothing")
    ap.add_argument("--measure", action="store_true", help="measure even for an hf-backend params file")
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5B", help="model size to estimate (Qwen2.5 shapes)")
    ap.add_argument("--hf-config", default=None, help="estimate for the config.json in this model folder")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prompt length to estimate with")
    args = ap.parse_args()
    cfg = load_config(args.params, args.overrides)
    if args.estimate or (cfg.model.backend == "hf" and not args.measure):
        shape = shape_from_hf_config(args.hf_config) if args.hf_config else SIZES[args.size]
        emit(report(cfg, shape, args.prompt_tokens, args.hf_config or f"Qwen2.5-{args.size} shape"))
        return
    overrides = [f"data.gsm8k_source={args.gsm8k or default_gsm8k()}", *([] if args.full else REDUCED),
                 *args.overrides]
    params = str(Path(args.params).resolve())
    results = []
    with workdir():
        for stage in STAGES:
            results.append(run_stage(stage, params, overrides))
            print(f"  {stage:9s} peak RSS {results[-1]['peak_rss_mb']:8.1f} MB  ({results[-1]['seconds']:.0f}s)"
                  + (f"  CUDA max allocated {results[-1]['cuda_max_allocated_mb']:.1f} MB"
                     if "cuda_max_allocated_mb" in results[-1] else ""), flush=True)
    print(f"load {load_avg()}; params {args.params}; " + ("full counts" if args.full else "reduced counts: "
                                                           + " ".join(REDUCED)))
    emit({"bench": "memory", "params": args.params, "reduced": not args.full, "stages": results,
          "max_peak_rss_mb": max(r["peak_rss_mb"] for r in results)})


if __name__ == "__main__":
    main()
