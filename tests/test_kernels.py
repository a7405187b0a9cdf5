"""`model.cpu_kernels`: which variables each setting puts into the environment, what a CPU without
the instruction set gets (one line naming the key, exit 2), and that the CLI applies the pin before
torch picks its kernels: in a fresh process, torch then reports the pinned kernels and MLflow records them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pipeline.core import kernels
from pipeline.core.errors import InputError
from tests.conftest import GSM8K, QUIET_ENV, REPO

AVX2_CPU = {"sse2", "avx", "avx2", "fma"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
ENV = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}


def test_each_setting_sets_both_libraries_or_nothing():
    x86 = "x86_64"
    assert kernels.pin_env("native", AVX512_CPU, x86) == {}
    assert kernels.pin_env("avx2", AVX512_CPU, x86) == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                                                        "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert kernels.pin_env("avx512", AVX512_CPU, x86) == {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512",
                                                          "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    compatible = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    assert kernels.pin_env("compatible", {"sse2"}, x86) == compatible
    assert kernels.pin_env("compatible", None, x86) == compatible
    assert kernels.pin_env("avx2", AVX2_CPU, machine="aarch64") == {}  # no x86 kernels to pin there


@pytest.mark.parametrize("setting, flags, message", [
    ("avx512", AVX2_CPU, "this CPU lacks avx512bw, avx512dq, avx512f, avx512vl; set model.cpu_kernels to native or "
                         "avx2 or compatible"),
    ("avx2", {"sse2", "avx"}, "this CPU lacks avx2, fma; set model.cpu_kernels to native or compatible"),
    ("avx2", None, "this CPU's feature flags cannot be read (/proc/cpuinfo) to check it has avx2, fma; set "
                   "model.cpu_kernels to native or compatible")])
def test_a_cpu_without_the_instruction_set_is_refused_by_name(setting, flags, message):
    with pytest.raises(InputError) as exc:
        kernels.pin_env(setting, flags, machine="x86_64")
    assert str(exc.value) == f"model.cpu_kernels = {setting}: {message}"
    with pytest.raises(InputError, match="allowed values are native, avx2, avx512, compatible"):
        kernels.pin_env("sse", AVX2_CPU, machine="x86_64")


def test_the_cli_refuses_a_pin_the_cpu_lacks_in_one_line(monkeypatch, capsys):
    """Exit 2 and one `error:` line naming the key, before any stage starts."""
    from pipeline.__main__ import main

    monkeypatch.setattr(kernels, "cpuinfo", lambda: (AVX2_CPU, "GenuineIntel"))
    monkeypatch.setattr(kernels, "is_x86_64", lambda machine=None: True)
    code = main(["sft", "--params", str(REPO / "configs" / "smoke.yaml"), "--set", "model.cpu_kernels=avx512"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: model.cpu_kernels = avx512: this CPU lacks avx512bw, avx512dq, avx512f, "
                                 "avx512vl; set model.cpu_kernels to native or avx2 or compatible"]


@pytest.mark.parametrize("value, vendor, branch", [("AVX2", "GenuineIntel", "AVX2"), ("AVX2", "AuthenticAMD", "AUTO"),
                                                   ("AVX512,STRICT", "AuthenticAMD", "AUTO"),
                                                   ("COMPATIBLE", "AuthenticAMD", "COMPATIBLE"),
                                                   ("BRANCH=AVX2", "GenuineIntel", "AVX2"), ("auto", "HygonGenuine", "AUTO")])
def test_the_mkl_branch_a_cpu_gets(value, vendor, branch):
    """MKL's documented rule: branches other than AUTO and COMPATIBLE on Intel CPUs only."""
    assert kernels.mkl_branch(value, vendor) == branch


def test_flags_and_vendor_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n\n"
                    "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n")
    assert kernels.cpuinfo(info) == ({"fpu", "sse2", "avx2", "fma"}, "AuthenticAMD")
    assert kernels.cpu_fields(info) == {"processor": "0", "vendor_id": "AuthenticAMD", "flags": "fpu sse2 avx2 fma"}
    info.write_text("processor\t: 0\n")
    assert kernels.cpuinfo(info) is None
    assert kernels.cpuinfo(tmp_path / "absent") is None


@pytest.mark.skipif(not kernels.is_x86_64(), reason="the pins are x86-64 kernels")
def test_apply_replaces_a_different_value_from_the_environment_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "cpuinfo", lambda: (AVX2_CPU, "GenuineIntel"))
    env = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX2", "OTHER": "x"}
    with caplog.at_level(logging.INFO, logger="pipeline.core.kernels"):
        assert kernels.apply("avx2", env) == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                                              "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OTHER": "x"}
    assert [r.getMessage() for r in caplog.records] == [
        "model.cpu_kernels = avx2: ATEN_CPU_CAPABILITY=avx2 replaces avx512 from the environment"]
    env = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert kernels.apply("native", env) == {} and env == {"ATEN_CPU_CAPABILITY": "avx512"}  # the user's choice stands


@pytest.mark.skipif(not kernels.is_x86_64(), reason="the pins are x86-64 kernels")
def test_a_non_intel_cpu_is_told_which_mkl_branch_it_gets(caplog, monkeypatch):
    """MKL honours the AVX2/AVX512 branches on Intel CPUs only (its AUTO branch elsewhere); COMPATIBLE everywhere."""
    monkeypatch.setattr(kernels, "cpuinfo", lambda: (AVX2_CPU, "AuthenticAMD"))
    with caplog.at_level(logging.INFO, logger="pipeline.core.kernels"):
        kernels.apply("avx2", {})
        kernels.apply("compatible", {})
    assert [r.getMessage() for r in caplog.records] == [
        "model.cpu_kernels = avx2: MKL keeps its AVX2 branch for Intel CPUs; on this AuthenticAMD CPU it takes its "
        "AUTO reproducibility branch"]


def _capability_after_pin(setting: str) -> tuple[str, str | None]:
    """What torch reports in a fresh process after the pin (MKL's branch is not readable back from
    torch: its variable is what this returns beside it), and the instruction set oneDNN's verbose log
    names when the rollout's packed linear runs (None where this torch has no oneDNN linear)."""
    code = ("import sys; from pipeline.core import kernels; kernels.apply(sys.argv[1]); import os, torch; "
            "from pipeline.model.fast import packed\n"
            "if packed.onednn_available(): packed.OneDNNWeight(torch.ones(4, 8), None, 2)(torch.ones(2, 8))\n"
            "print('torch:', torch.backends.cpu.get_cpu_capability(), os.environ.get('MKL_CBWR'))")
    env = {k: v for k, v in ENV.items() if k not in kernels.ENV_VARS} | {"ONEDNN_VERBOSE": "1"}
    res = subprocess.run([sys.executable, "-c", code, setting], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    isa = [line.split("isa:", 1)[1] for line in lines if line.startswith("onednn_verbose") and ",isa:" in line]
    return next(line for line in lines if line.startswith("torch: ")).removeprefix("torch: "), (isa or [None])[0]


@pytest.mark.skipif(not kernels.is_x86_64(), reason="the pins are x86-64 kernels")
@pytest.mark.slow
def test_torch_computes_with_the_pinned_kernels():
    from pipeline.model.fast import packed

    onednn = packed.onednn_available()
    assert _capability_after_pin("compatible") == ("DEFAULT COMPATIBLE", "Intel SSE4.1" if onednn else None)
    if {"avx2", "fma"} <= (kernels.cpuinfo() or (set(), ""))[0]:
        assert _capability_after_pin("avx2") == ("AVX2 AVX2", "Intel AVX2" if onednn else None)


@pytest.mark.skipif(not kernels.is_x86_64(), reason="the pins are x86-64 kernels")
@pytest.mark.slow
def test_the_cli_pins_before_the_stage_loads_torch_and_mlflow_records_it(tmp_path):
    """A stage run by `python -m pipeline` with the pin set to a kernel set below any x86-64 CPU's
    native one: torch in the stage's process reports scalar kernels, and the stage's MLflow run is tagged
    with them and with both variables."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {k: v for k, v in ENV.items() if k not in kernels.ENV_VARS}
    res = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(REPO / "configs" / "smoke.yaml"),
                          "--set", f"data.gsm8k_source={GSM8K}", "--set", "model.cpu_kernels=compatible",
                          "--set", "tracking.enabled=true", "--set", f"tracking.uri={store}",
                          "--set", "tracking.experiment=kernels"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("kernels").experiment_id])
    tags = run.data.tags
    assert (tags["env.cpu_kernels"], tags["env.ATEN_CPU_CAPABILITY"], tags["env.MKL_CBWR"], tags["env.mkl_branch"]) == \
        ("DEFAULT", "default", "COMPATIBLE", "COMPATIBLE")
