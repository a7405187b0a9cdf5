"""Which CPU kernels a run computes with: `model.cpu_kernels`, applied before torch is imported.

torch picks its vector kernels (AVX2, AVX512, ...) and MKL its GEMM code path from the CPU it runs
on, and each changes the order of floating-point sums. A run is bit-identical on one machine but
not across machines: the same SFT has landed 10 points apart on two CPUs
(docs/results/reproducibility.md). Pinning both to one instruction set gives the same bits on every
x86-64 CPU that has it, at the cost of the wider kernels a newer CPU would pick:

- ``native``: whatever this CPU has (and ``ATEN_CPU_CAPABILITY`` / ``MKL_CBWR`` from the
  environment, if the user set them): the fastest, not reproducible across CPU generations;
- ``avx2`` (the default): torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``) and MKL's conditional
  numerical reproducibility branch for AVX2 (``MKL_CBWR=AVX2``): any x86-64 CPU with AVX2 and FMA
  (Intel since 2013, AMD since 2015);
- ``avx512``: the same for AVX512 (F, BW, DQ, VL);
- ``compatible``: torch's scalar kernels and MKL's ``COMPATIBLE`` branch: any x86-64 CPU, slowest.

The figures also depend on the thread and process counts (``model.num_threads``, ``sft.nproc``),
which are params already. What is pinned is torch's own CPU ops and MKL; oneDNN (bf16 on CPU) and
CUDA kernels are not. On a CPU that is not x86-64 a pin cannot apply: the run uses native kernels
and says so. No torch import here: the CLI calls :func:`apply` before anything imports torch.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import MutableMapping
from pathlib import Path

from pipeline.errors import InputError

log = logging.getLogger(__name__)

# setting -> (ATEN_CPU_CAPABILITY, MKL_CBWR, /proc/cpuinfo flags the CPU needs, what torch reports)
PINS = {
    "avx2": ("avx2", "AVX2", ("avx2", "fma"), "AVX2"),
    "avx512": ("avx512", "AVX512", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"), "AVX512"),
    "compatible": ("default", "COMPATIBLE", (), "DEFAULT"),
}
SETTINGS = ("native", *PINS)
ENV_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def pin_env(setting: str, flags: set[str] | None, machine: str | None = None) -> dict[str, str]:
    """The environment `setting` needs on this CPU ({} for ``native`` or a CPU that is not x86-64);
    an InputError naming the key where the CPU lacks the instruction set (torch would not check:
    its AVX512 kernels on a CPU without AVX512 stop at the first illegal instruction)."""
    if setting not in SETTINGS:
        raise InputError(f"model.cpu_kernels = {setting!r}: allowed values are {', '.join(SETTINGS)}")
    if setting == "native" or not is_x86_64(machine):
        return {}
    aten, mkl, needs, _ = PINS[setting]
    missing = sorted(set(needs) - flags) if flags is not None else []
    if missing:
        raise InputError(f"model.cpu_kernels = {setting}: this CPU lacks {', '.join(missing)}; set model.cpu_kernels "
                         f"to an instruction set it has (avx2, compatible) or native")
    return {"ATEN_CPU_CAPABILITY": aten, "MKL_CBWR": mkl}


def apply(setting: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `setting`'s variables into the environment (this process and every process it starts:
    torchrun's ranks, the evaluate stage's workers) and return them. Where torch is already
    imported its kernels may be fixed already: then the kernels torch reports are checked, and a
    mismatch is logged (the run goes on with them)."""
    environ = os.environ if environ is None else environ
    if setting != "native" and not is_x86_64():
        log.warning("model.cpu_kernels = %s applies to x86-64 CPUs; this is %s: native kernels, so the figures "
                    "will not match an x86-64 run's", setting, platform.machine())
    env = pin_env(setting, cpu_flags())
    for var, value in env.items():
        old = environ.get(var)
        if old is not None and old != value:
            log.warning("model.cpu_kernels = %s: %s=%s replaces %s from the environment", setting, var, value, old)
        environ[var] = value
    if env and "torch" in sys.modules:
        import torch

        have, want = torch.backends.cpu.get_cpu_capability(), PINS[setting][3]
        if have != want:
            log.warning("model.cpu_kernels = %s: torch was imported before the pin and computes with %s kernels; "
                        "run the stage through `python -m pipeline` for %s", setting, have, want)
    return env
