"""Helpers shared by the benchmarks: environment, the GSM8K path, a prepared temp working dir,
alternating timers, the machine's matmul peak and FLOP counts of the from-scratch GPT.

Every benchmark prints its figures and, as its LAST line, one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for _k, _v in {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def default_gsm8k() -> str:
    """The local GSM8K copy named by $GSM8K, else the one committed under datasets/gsm8k (never the
    hub). The 80/30-row test fixture, tests/fixtures/gsm8k, is enough for timing an iteration, not for
    the evaluate stage's batches."""
    cand = os.environ.get("GSM8K")
    if cand and Path(cand).exists():
        return str(Path(cand).resolve())
    committed = ROOT / "datasets" / "gsm8k"
    if (committed / "train.jsonl").is_file():
        return str(committed)
    raise SystemExit("no local GSM8K copy: pass --gsm8k PATH or set GSM8K=PATH "
                     "(a folder with train.jsonl and test.jsonl)")


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_line(threads: int) -> str:
    import platform

    import torch

    from pipeline.tracking.common import cpu_model

    return (f"{cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"load {load_avg()}; torch {torch.__version__}, {threads} thread(s), "
            f"kernels {torch.backends.cpu.get_cpu_capability()}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def alternate(runs: dict[str, Callable[[], Any]], repeats: int, warm_up: bool = True) -> dict[str, list[float]]:
    """Seconds of each run, `repeats` times, interleaved so drifting load hits every side alike."""
    if warm_up:
        for fn in runs.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn)[0])
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def pair_ratios(times: dict[str, list[float]], slow: str, fast: str) -> dict[str, float]:
    """min / median / max over the interleaved repeats of ``times[slow][i] / times[fast][i]``: each
    ratio pairs two runs taken back to back, so load that drifts between repeats cancels out."""
    ratios = [s / f for s, f in zip(times[slow], times[fast])]
    return {"min": round(min(ratios), 3), "median": round(statistics.median(ratios), 3),
            "max": round(max(ratios), 3)}


def fmt_ratios(r: dict[str, float]) -> str:
    return f"{r['median']:.2f}x (min {r['min']:.2f}, max {r['max']:.2f})"


def count_aten_ops(fn: Callable[[], Any]) -> int:
    """How many ops `fn` dispatches (``TorchDispatchMode``: the calls a Python program makes, after
    autograd, each of which pays the fixed per-op cost; what a kernel calls inside is not counted).
    A load-independent measure of per-step overhead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def add_decode_workload_args(ap) -> None:
    """The decoding workload of bench/rollout.py (a model of `--layers` x `--width`, `--prompts` prompts
    of `--prompt-len` tokens, `--group` samples each, `--new-tokens` new tokens), shared by the
    benchmarks that time decoding, so that their defaults are the same workload."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)


def _best_of(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def gemms(a, b) -> dict:
    """The products ``a @ b`` this torch build can time for `a` (m x k) and `b` (k x n), by library:
    ``mm`` (torch.mm: MKL in fp32 on x86 CPUs, oneDNN in bf16, cuBLAS on CUDA) and, on CPU,
    ``onednn`` (oneDNN's linear on `b` packed for m rows here, once, outside the calls). Each a
    callable returning the product."""
    import torch

    from bench.onednn import OneDNNWeight, onednn_linear_available

    out = {"mm": lambda: torch.mm(a, b)}
    if a.device.type == "cpu" and onednn_linear_available():
        w = OneDNNWeight(b.t().contiguous(), None, a.shape[0])
        out["onednn"] = lambda: w(a)
    return out


def _best_mm_seconds_by_library(m: int, k: int, n: int, repeats: int, dtype: str, device: str) -> dict[str, float]:
    """Best seconds of one (m x k) @ (k x n) product of random operands (after a warm-up; CUDA
    synced) by each of :func:`gemms` (oneDNN's pre-packed linear is 1.1-1.2x MKL at some fp32 shapes
    of an iteration: docs/results/speed.md)."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(m, k, dtype=dt, device=device)
    b = torch.randn(k, n, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    return {library: _best_of(fn, repeats, sync) for library, fn in gemms(a, b).items()}


def _best_mm_seconds(m: int, k: int, n: int, repeats: int, dtype: str, device: str) -> float:
    """Best seconds of one (m x k) @ (k x n) product: the fastest of the GEMMs this torch build has
    for it (:func:`_best_mm_seconds_by_library`)."""
    return min(_best_mm_seconds_by_library(m, k, n, repeats, dtype, device).values())


def matmul_peak(n: int = 1024, repeats: int = 5, dtype: str = "float32", device: str = "cpu") -> float:
    """Best FLOP/s of an (n x n) @ (n x n) product at the current thread count, the fastest of this
    torch build's GEMMs (:func:`_best_mm_seconds`): the machine's practical matmul peak at that
    shape (best of `repeats`, after a warm-up)."""
    return 2 * n ** 3 / _best_mm_seconds(n, n, n, repeats, dtype, device)


def matmul_weights(module) -> list[tuple[int, int]]:
    """(out, in) of every weight that enters a matmul once per token: every >=2-D parameter except
    the embedding lookup, a tied LM head counted once as a matmul."""
    import torch

    seen, shapes = set(), []
    emb = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(module, "lm_head", None)
    for p in module.parameters():
        if p.dim() < 2 or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in emb and not (head is not None and head.weight is p):
            continue
        shapes.append((p.shape[0], p[0].numel()))
    return shapes


def matmul_params(module) -> int:
    """Weights that enter a matmul once per token (the 'N' of 2N/6N): see :func:`matmul_weights`."""
    return sum(o * i for o, i in matmul_weights(module))


def matmul_ceiling(shapes: list[tuple[int, int]], rows: int, repeats: int = 5, dtype: str = "float32",
                   device: str = "cpu") -> float:
    """FLOP/s of the model's own weight matmuls at `rows` rows: (rows x in) @ (in x out) for every
    (out, in) in `shapes`, best of `repeats` each, total FLOPs over total time: what this machine's
    BLAS gives these shapes, so how far an iteration is from its matmuls' own speed (82-85% of the
    best of the iteration's own shapes for the 4x128 default's weights: docs/results/speed.md)."""
    flops = sum(2 * rows * in_f * out_f for out_f, in_f in shapes)
    secs = sum(_best_mm_seconds(rows, in_f, out_f, repeats, dtype, device) for out_f, in_f in shapes)
    return flops / secs


def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 / AMX); without them a bf16
    matmul is emulated and slower than fp32, so there is no bf16 peak to report."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class ShapePeak:
    """The practical matmul peak over the shapes an iteration runs: each weight (out, in) at each of
    its row counts (prefill, decode, log-prob/update passes), best FLOP/s of any one shape by any of
    this torch build's GEMMs (on CPU MKL's ``mm`` and oneDNN's pre-packed linear: the best the
    hardware shows, not only the library the iteration calls). Call :meth:`measure` between
    iterations (interleaved, so it sees the same load) and read `best`: the max over every call,
    with the shape (`best_shape`) and the GEMM (`best_library`) that gave it."""

    def __init__(self, dtype: str = "float32", repeats: int = 3) -> None:
        self.dtype, self.repeats = dtype, repeats
        self.best, self.best_shape, self.best_library = 0.0, None, None

    def measure(self, shapes: list[tuple[int, int]], rows: list[int]) -> float:
        for m in sorted(set(rows)):
            for out_f, in_f in sorted(set(shapes)):
                secs = _best_mm_seconds_by_library(m, in_f, out_f, self.repeats, self.dtype, "cpu")
                for library, t in secs.items():
                    rate = 2 * m * in_f * out_f / t
                    if rate > self.best:
                        self.best, self.best_shape, self.best_library = rate, (m, in_f, out_f), library
        return self.best


@contextlib.contextmanager
def workdir(keep: bool = False):
    """A temp working directory (cwd while inside); removed afterwards unless `keep`."""
    old = os.getcwd()
    tmp = tempfile.mkdtemp(prefix="grpo-bench-")
    os.chdir(tmp)
    try:
        yield Path(tmp)
    finally:
        os.chdir(old)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "bench@localhost"}


def copy_repo(dst: Path, gsm8k: str | Path, git: bool = True) -> Path:
    """The repo's tracked (and not ignored) files, without .ci/ and tests/, copied into `dst`, with
    the smoke config written out in full as params.yaml and GSM8K read from `gsm8k`; with `git`,
    `dst` becomes a fresh git repo of one commit. Used by bench/overhead.py and the flow/DVC tests."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file() and not rel.startswith((".ci/", "tests/")):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    # written out in full: DVC tracks (and `dvc exp run -S` can set) only keys present in the file
    from pipeline.core.config_loading import dump_config, load_config

    smoke = load_config(ROOT / "configs" / "smoke.yaml", [f"data.gsm8k_source={gsm8k}"])
    (dst / "params.yaml").write_text(dump_config(smoke))
    if git:
        env = {**os.environ, **GIT_ENV}
        for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
            subprocess.run(cmd, cwd=dst, check=True, env=env)
    return dst


class GRPOIterations:
    """One GRPO stage's set-up and single iterations, outside its loop (no logging, no saving):
    what the benchmarks time. `iteration()` runs `pipeline.stages.grpo.grpo_iteration` once."""

    def __init__(self, cfg, stage: str) -> None:
        from pipeline.stages import grpo

        self.run = grpo.setup(cfg, stage)
        self.state = grpo.TrainState(total_iters=self.run.conf.iterations)
        self.policy, self.g = self.run.policy, self.run.conf

    def iteration(self) -> tuple[dict, list]:
        from pipeline.stages import grpo

        out = grpo.grpo_iteration(self.run, self.state)
        self.state.iteration += 1
        return out


def prepare_with_random_policy(cfg) -> None:
    """In the cwd: run the prepare stage, then save ONE randomly initialised policy (seeded) as both
    checkpoints/sft and checkpoints/warmup. Random weights are fine for timing (they rarely emit a
    stop token, so rollouts run to full length: the worst case for time per iteration)."""
    import torch

    from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.stages.prepare import run_prepare
    from pipeline.train.checkpoint import init_policy, save_policy

    run_prepare(cfg)
    tok = load_tokenizer(Path(DATA_DIR)) if cfg.model.backend == "gpt" else None  # hf: model.init's own
    torch.manual_seed(0)
    policy = init_policy(cfg.model, tok)
    for name in ("sft", "warmup"):
        save_policy(Path(CHECKPOINT_DIR) / name, policy)


def synthetic_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Arithmetic Q/A plus pseudo-words: enough merges for a 2048-token BPE vocabulary."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(f"Question: What is {a} + {b}?\nAnswer: {a} + {b} = <answer>{a + b}</answer> "
                   + " ".join(rng.choice(words) for _ in range(8)))
    return out


def arith_rows(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """`n` two-digit addition rows in the processed-JSONL schema, with the default prompt template."""
    import random

    from pipeline.core.config import DEFAULT_TEMPLATE

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        q = f"What is {a} + {b}?"
        out.append({"id": f"b{i}", "source": "arith", "question": q, "prompt": DEFAULT_TEMPLATE.format(question=q),
                    "gold": float(a + b), "solution": f"{a} + {b} = <answer>{a + b}</answer>", "level": 1})
    return out


def write_rows(rows: list[dict[str, Any]]) -> None:
    """In the cwd: `rows` as data/gsm8k_train.jsonl (and one as gsm8k_val.jsonl) for the grpo stage."""
    from pipeline.core.config import DATA_DIR
    from pipeline.stages.prepare import write_jsonl

    Path(DATA_DIR).mkdir(exist_ok=True)
    write_jsonl(Path(DATA_DIR) / "gsm8k_train.jsonl", rows)
    write_jsonl(Path(DATA_DIR) / "gsm8k_val.jsonl", rows[:1])


def emit(result: dict[str, Any]) -> None:
    """The machine-readable last line."""
    print(json.dumps(result, default=str), flush=True)
