"""Which CPU kernels a run computes with: `model.cpu_kernels`, applied before torch is imported.

torch picks its vector kernels (AVX2, AVX512, ...), MKL its GEMM code path and oneDNN its own (the
rollout's fp32 decode matmuls, bf16 on CPU) from the CPU it runs on, and each changes the order of
floating-point sums. A run is bit-identical on one machine, not
across machines: the same SFT has landed 10 points apart on two CPUs
(docs/results/reproducibility.md). This param makes the kernels part of the run's params (DVC
re-runs the stages when it changes; MLflow records what torch reports):

- ``native`` (the default): whatever this CPU has, or ``ATEN_CPU_CAPABILITY`` / ``MKL_CBWR`` /
  ``ONEDNN_MAX_CPU_ISA`` from the environment where the user set them;
- ``avx2`` / ``avx512``: torch's AVX2 / AVX512 kernels on any x86-64 CPU that has the instruction
  set, oneDNN's code for that set at most (``ONEDNN_MAX_CPU_ISA`` ``AVX2`` / ``AVX512_CORE``: no
  VNNI, bf16 or AMX instructions, so bf16 on CPU is slower under the pin), and MKL's conditional
  numerical reproducibility (CNR) branch of that name. MKL documents that
  it honours those branches on Intel CPUs only and takes its ``AUTO`` CNR branch elsewhere (its own
  ISA dispatch with deterministic reductions and fixed cache sizes), whose sums differ from the
  native ones (measured on an AMD CPU: docs/results/reproducibility.md);
- ``compatible``: torch's scalar kernels, oneDNN's SSE4.1 code and MKL's ``COMPATIBLE`` branch (SSE2
  without approximate reciprocals), the one branch MKL documents for every x86-64 CPU, Intel or not; an iteration took
  2.3x the native time on one AMD CPU (docs/results/reproducibility.md).

Which bits agree across CPUs under a pin rests on MKL's and torch's documented behaviour; no pair
of machines has been compared under one yet. The figures also depend on the thread and process
counts (``model.num_threads``, ``sft.nproc``), which are params already. CUDA kernels are not pinned. On a CPU that is not x86-64 no setting applies (the run says so). No
torch import here: the CLI calls :func:`apply` before anything imports torch.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import MutableMapping
from pathlib import Path

from pipeline.core.errors import InputError

log = logging.getLogger(__name__)

# setting -> (ATEN_CPU_CAPABILITY, MKL_CBWR, /proc/cpuinfo flags the CPU needs, what torch reports,
# ONEDNN_MAX_CPU_ISA)
PINS = {
    "avx2": ("avx2", "AVX2", ("avx2", "fma"), "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"), "AVX512", "AVX512_CORE"),
    "compatible": ("default", "COMPATIBLE", (), "DEFAULT", "SSE41"),
}
SETTINGS = ("native", *PINS)
ENV_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def cpu_fields(path: Path = Path("/proc/cpuinfo")) -> dict[str, str] | None:
    """The fields of /proc/cpuinfo (Linux), each key's first value in the file (the first
    processor's, stripped), or None where the file cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[set[str], str] | None:
    """The CPU's feature flags and vendor (Linux), or None where they cannot be read."""
    fields = cpu_fields(path)
    if fields is None or "flags" not in fields:
        return None
    return set(fields["flags"].split()), fields.get("vendor_id", "")


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def pin_env(setting: str, flags: set[str] | None, machine: str | None = None) -> dict[str, str]:
    """The environment `setting` needs on this CPU ({} for ``native`` or a CPU that is not x86-64);
    an InputError naming the key where the CPU lacks the instruction set, or where its flags cannot
    be read (torch does not check: its AVX512 kernels on a CPU without AVX512 stop at the first
    illegal instruction)."""
    if setting not in SETTINGS:
        raise InputError(f"model.cpu_kernels = {setting!r}: allowed values are {', '.join(SETTINGS)}")
    if setting == "native" or not is_x86_64(machine):
        return {}
    aten, mkl, needs, _, onednn = PINS[setting]
    if needs and flags is None:
        raise InputError(f"model.cpu_kernels = {setting}: this CPU's feature flags cannot be read (/proc/cpuinfo) "
                         f"to check it has {', '.join(needs)}; set model.cpu_kernels to native or compatible")
    missing = sorted(set(needs) - (flags or set()))
    if missing:
        fits = [name for name, pin in PINS.items() if set(pin[2]) <= (flags or set())]
        raise InputError(f"model.cpu_kernels = {setting}: this CPU lacks {', '.join(missing)}; set model.cpu_kernels "
                         f"to {' or '.join(['native', *fits])}")
    return {"ATEN_CPU_CAPABILITY": aten, "MKL_CBWR": mkl, "ONEDNN_MAX_CPU_ISA": onednn}


def mkl_branch(value: str, vendor: str | None) -> str:
    """The CNR branch MKL takes for ``MKL_CBWR=value`` on a CPU of `vendor` (``vendor_id``): branches
    other than AUTO and COMPATIBLE on Intel CPUs only, AUTO elsewhere (MKL's documented rule)."""
    branch = value.split(",")[0].removeprefix("BRANCH=").strip().upper()
    if branch in ("AUTO", "COMPATIBLE") or vendor == "GenuineIntel" or not vendor:
        return branch
    return "AUTO"


def apply(setting: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `setting`'s variables into `environ` (default: this process's, and so every process it
    starts: torchrun's ranks, the evaluate stage's workers) and return them. Where torch is already
    imported in this process its kernels may be fixed already: then the kernels torch reports are
    checked, and a mismatch is logged (the run goes on with them)."""
    live = environ is None  # this process's own environment: torch may already have read it
    environ = os.environ if environ is None else environ
    if setting != "native" and not is_x86_64():
        log.warning("model.cpu_kernels = %s applies to x86-64 CPUs; this is %s: native kernels", setting,
                    platform.machine())
    info = cpuinfo()
    env = pin_env(setting, None if info is None else info[0])
    if env and info is not None and mkl_branch(env["MKL_CBWR"], info[1]) != env["MKL_CBWR"]:
        log.info("model.cpu_kernels = %s: MKL keeps its %s branch for Intel CPUs; on this %s CPU it takes its AUTO "
                 "reproducibility branch", setting, env["MKL_CBWR"], info[1])
    for var, value in env.items():
        old = environ.get(var)
        if old is not None and old != value:
            log.warning("model.cpu_kernels = %s: %s=%s replaces %s from the environment", setting, var, value, old)
        environ[var] = value
    if env and live and "torch" in sys.modules:
        import torch

        have, want = torch.backends.cpu.get_cpu_capability(), PINS[setting][3]
        if have != want:
            log.warning("model.cpu_kernels = %s: torch was imported before the pin and computes with %s kernels; "
                        "run the stage through `python -m pipeline` for %s", setting, have, want)
    return env
