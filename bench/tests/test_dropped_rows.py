"""bench/dropped_rows.py end to end on a smoke workspace (prepare, then a few SFT steps): both arms
run on every workload of the grid, their completions agree, and the last line is the JSON the docs
quote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dropped_rows_bench_times_both_arms_on_every_workload(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = ["--set", f"data.gsm8k_source={ROOT / 'tests' / 'fixtures' / 'gsm8k'}", "--set", "tracking.enabled=false"]
    for stage in ("prepare", "sft"):
        subprocess.run([sys.executable, "-m", "pipeline", stage, "--params", str(ROOT / "configs" / "smoke.yaml"),
                        *sets], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=600)
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "dropped_rows.py"), "--params",
                          str(ROOT / "configs" / "smoke.yaml"), "--limit", "6", "--batch", "4", "2",
                          "--batches", "1", "--repeats", "2"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "dropped_rows"
    cells = {(w["workload"], w["task"], w["batch"]) for w in out["workloads"]}
    assert {("greedy", "gsm8k", 4), ("greedy", "gsm8k", 2), ("greedy", "arith", 4), ("greedy", "arith", 2)} <= cells
    assert {w["workload"] for w in out["workloads"]} >= {"greedy", "warmup", "grpo"}
    for w in out["workloads"]:
        assert w["same_completions"] is True and 0 < w["useful_row_steps"] <= 1
        assert len(w["every_row_s"]) == len(w["dropped_s"]) == 2
        assert 0 < w["speedup"]["min"] <= w["speedup"]["median"] <= w["speedup"]["max"]
        if w["workload"] == "greedy":
            assert w["budget"] == 16  # the smoke params' evaluate.max_new_tokens
