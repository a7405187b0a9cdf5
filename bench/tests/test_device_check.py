"""bench/device_check.sh fits a lease: its step limits add up to at most 8 minutes (a lease is 15
minutes of device time for everything, start-up included), every step runs under its own limit, and
its CPU dry run (`DRY_RUN=1`: every step on a tiny shape) prints one ok JSON line per step, in order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
STEPS = ["env", "tests", "build", "eager", "lora", "recompute", "bf16", "compiled"]  # in order of value
BUDGET_S = 480
KEYS = {"step", "ok", "seconds", "limit_s", "tokens_per_s", "mfu", "peak_mem_gb"}


def _commands() -> list[str]:
    """The script's lines without comments."""
    return [line.split("#", 1)[0] for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]


def test_the_step_limits_add_up_to_at_most_eight_minutes():
    table = re.search(r"declare -A limit=\(([^)]*)\)", SCRIPT.read_text())
    assert table, "no `declare -A limit=(...)` table of step limits"
    limits = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table.group(1))}
    assert list(limits) == STEPS
    assert sum(limits.values()) <= BUDGET_S, limits
    # the one `timeout` is the step runner's, which takes each step's limit from the table
    assert sum(len(re.findall(r"\btimeout\b", line)) for line in _commands()) == 1


def test_a_step_line_takes_the_iteration_figures_and_says_why_a_step_failed(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import device_line

    result = {"bench": "grpo_iteration", "tokens_per_s": 9494.0, "fraction_of_peak": 0.071,
              "max_cuda_memory_gib": 32.9, "seconds_per_iteration": 7.43, "device": "NVIDIA H200"}
    line = device_line.step_line("eager", 0, 52, 100, "model: qwen2\n" + json.dumps(result))
    assert KEYS <= line.keys() and line["ok"] and not line["timed_out"]
    assert (line["tokens_per_s"], line["mfu"], line["peak_mem_gb"]) == (9494.0, 0.071, round(32.9 * 2**30 / 1e9, 3))
    cut = device_line.step_line("compiled", 124, 127, 125, "compiling\nstill compiling")
    assert not cut["ok"] and cut["timed_out"] and cut["tokens_per_s"] is None and cut["tail"] == ["compiling",
                                                                                                   "still compiling"]
    tests = device_line.step_line("tests", 0, 20, 40, "...\n===== 3 passed, 19 deselected in 9.10s =====")
    assert tests["ok"] and tests["tests"] == "3 passed, 19 deselected in 9.10s"
    assert not device_line.step_line("lora", 0, 0, 55, "", skipped="peft not installed")["ok"]


@pytest.mark.slow
def test_the_dry_run_prints_an_ok_json_line_per_step(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    env.pop("ONLY", None)
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == STEPS, res.stdout + res.stderr[-3000:]
    for x in lines:
        assert KEYS <= x.keys() and x["ok"] is True, (x, (tmp_path / "out" / f"{x['step']}.txt").read_text()[-3000:])
        assert x["seconds"] <= x["limit_s"]
    for x in lines[3:]:  # the GRPO iterations
        assert x["tokens_per_s"] > 0 and 0 < x["mfu"] < 1, x
    saved = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert saved == lines
    assert res.returncode == 0
