"""What the tracking facade and its MLflow adapter share, with no tracker SDK: the environment
contract with orchestrators, the error type, git and machine facts, the run's readable name.

Orchestrators pass context down through environment variables, never imports:

- ``GRPO_PARENT_RUN_ID``: the MLflow parent run of this pipeline execution (opened by the Prefect
  flow, ``python -m pipeline all`` or ``make run``); stages nest under it and never close it.
- ``GRPO_PREFECT_FLOW_RUN_ID``: tagged on every run a flow's stages log.
- ``GRPO_RUN_NAME``: the experiment's name when the caller names it (the Prefect flow run);
  ``DVC_EXP_NAME`` (set by ``dvc exp run``) otherwise.
- ``DVC_ROOT`` (set by DVC for every stage, the user's repo even under ``dvc exp run --temp`` and
  queued experiments): where a relative sqlite tracking URI resolves.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.config import CHECKPOINT_DIR, DATA_DIR, METRICS_DIR, PLOTS_DIR, REPORTS_DIR, STAGE_BY_NAME, STAGE_TABLE, Config
from pipeline.core.errors import InputError
from pipeline.core.kernels import cpu_fields, cpuinfo, mkl_branch

PARENT_RUN_ENV = "GRPO_PARENT_RUN_ID"
FLOW_RUN_ENV = "GRPO_PREFECT_FLOW_RUN_ID"
RUN_NAME_ENV = "GRPO_RUN_NAME"
ROOT_ENV = "DVC_ROOT"
# The pipeline's own outputs (and the lock DVC writes beside them): a rewritten metric or plot file is
# a result of the run, not a change to what was run, so it does not make the checkout "dirty".
OUTPUT_PATHS = (DATA_DIR, CHECKPOINT_DIR, METRICS_DIR, PLOTS_DIR, REPORTS_DIR, "dvc.lock")
# Changed params do not make it "dirty" either: every value is logged as the run's params, so nothing
# is hidden, and `dvc exp run -S` (which edits params.yaml) and a flow's `--set` (which edits a copy)
# then tag the same kind of change alike.
PARAMS_PATHS = ("params.yaml",)


class TrackingUnavailableError(InputError):
    """The MLflow tracking backend cannot be reached; raised before any training starts."""

    kind = "tracking"  # an outage may pass: the flow's tasks retry it


@contextlib.contextmanager
def temporary_env(values: dict[str, str | None]) -> Iterator[None]:
    """Set environment variables (None or "" leaves one unset) for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items() if v})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def repo_root() -> Path:
    """The user's repository: ``DVC_ROOT`` under DVC (the original repo, also for temp experiments),
    else the working directory (the CLI and the flow run from the repo root)."""
    return Path(os.environ.get(ROOT_ENV) or ".").resolve()


def resolve_uri(uri: str, root: Path | None = None) -> str:
    """A relative sqlite path (``sqlite:///mlflow.db``) made absolute at the repository root, so an
    experiment run in a temporary copy logs to the user's database; other URIs unchanged."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/") and uri[len(prefix):] != ":memory:":
        return prefix + str((root or repo_root()) / uri[len(prefix):])
    return uri


def _git(*args: str, cwd: str | Path = ".") -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(cwd: str | Path = ".") -> tuple[str | None, bool]:
    """(HEAD commit, dirty): dirty when a git-tracked file other than the pipeline's outputs and its
    params file (logged in full as the run's params) changed.

    Untracked files never count (DVC outputs are git-ignored, and a new file is not part of what
    ran); nothing here reads DVC's files: the outputs are the library's own folders.
    """
    head = _git("rev-parse", "HEAD", cwd=cwd)
    if head is None:
        return None, False
    excludes = [f":(exclude){p}" for p in (*OUTPUT_PATHS, *PARAMS_PATHS)]
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *excludes, cwd=cwd)
    return head.strip(), bool(status and status.strip())


def experiment_label() -> str | None:
    """The name of the experiment this run belongs to (the flow run's, else DVC's), or None."""
    return os.environ.get(RUN_NAME_ENV) or os.environ.get("DVC_EXP_NAME") or None


STAGE_KEY_PARAMS = {s.name: s.key_params for s in STAGE_TABLE}  # what tells two runs apart in a list of names


def run_name(cfg: Config, stage: str | None = None, label: str | None = None) -> str:
    """A run name that reads in a list: ``grpo · nightly-0412 · kl_coef=0.02 lr=1e-05 ...``."""
    flat = cfg.flat()
    keys = STAGE_KEY_PARAMS.get(stage or "grpo", ())
    params = " ".join(f"{k.split('.', 1)[1]}={flat[k]:g}" if isinstance(flat.get(k), float)
                      else f"{k.split('.', 1)[1]}={flat.get(k)}" for k in keys if k in flat)
    return " · ".join(p for p in (stage or "pipeline", label or experiment_label(), params) if p)


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    fields = cpu_fields()
    return None if fields is None else fields.get("model name")


def runtime_tags() -> dict[str, str]:
    """What a run's floating-point results depend on beyond code, params and data.

    Runs are bit-identical on one machine, not across machines: torch picks its vector kernels
    (``env.cpu_kernels``: AVX2, AVX512, ...) and MKL its GEMM code path from the CPU, which changes
    the order of floating-point sums. Measured (docs/results/reproducibility.md): the 2000-step SFT
    landed at 70.5% held-out greedy on one 2-core machine and 81.0% on another, same code, params
    and wheel; on one machine, ``ATEN_CPU_CAPABILITY=avx2`` instead of the AVX512 default changed its
    logged loss from step 200 on (1.8929 against 1.8927) and its end point. ``ATEN_CPU_CAPABILITY``,
    ``MKL_CBWR`` and ``ONEDNN_MAX_CPU_ISA`` are recorded when set (``model.cpu_kernels`` sets them),
    and ``env.mkl_branch``, the branch MKL takes for ``MKL_CBWR`` on this CPU.
    """
    import platform

    import torch

    tags = {"env.torch": torch.__version__, "env.python": platform.python_version(),
            "env.cpu_kernels": torch.backends.cpu.get_cpu_capability(), "env.machine": platform.machine()}
    if model := cpu_model():
        tags["env.cpu"] = model
    if torch.version.cuda:
        tags["env.cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never the first CUDA call (fork safety)
        tags["env.cuda_device"] = torch.cuda.get_device_name(torch.cuda.current_device())
    for var in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"):
        if os.environ.get(var):
            tags[f"env.{var}"] = os.environ[var]
    if os.environ.get("MKL_CBWR"):  # what MKL takes for it on this CPU (AUTO on a non-Intel one)
        info = cpuinfo()
        tags["env.mkl_branch"] = mkl_branch(os.environ["MKL_CBWR"], None if info is None else info[1])
    return tags


# --------------------------------------------------------------------------- what a stage produced

def stage_outs(stage: str, work: Path | None = None) -> list[Path]:
    """The paths ``stage`` writes (the stage table's ``outs``, which a test holds equal to dvc.yaml's;
    the library never opens dvc.yaml); none for a stage outside the table (a recipe's ``model``)."""
    work = work or Path(".")
    row = STAGE_BY_NAME.get(stage)
    return [work / o for o in row.outs] if row else []


def outputs_digest(stage: str, work: Path | None = None) -> str | None:
    """One SHA-256 over the contents of ``stage``'s outputs (every file under them, by path relative
    to the working folder): the same outputs give the same digest, whichever run or machine wrote
    them. A stage run is tagged with it (``grpo.outputs``), so a pipeline run that DVC let skip the
    stage can name the run that produced what it used. None without outputs."""
    work = work or Path(".")
    files = sorted(f for out in stage_outs(stage, work) for f in ([out] if out.is_file() else out.rglob("*"))
                   if f.is_file() and not f.name.startswith("."))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(work)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


# The generation params of a checkpoint's MLflow Model (pipeline/policy_model.py) and their
# defaults: its signature (pipeline.tracking.mlflow_models) and its predict() read them from here.
POLICY_MODEL_PARAMS: dict[str, object] = {"max_new_tokens": 256, "greedy": True, "temperature": 1.0, "top_p": 1.0,
                                          "batch_size": 16, "seed": 0}
