"""bench/greedy_eval.py end to end on a smoke workspace (prepare, then a few SFT steps): both arms
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
def test_greedy_eval_bench_times_both_arms_on_every_workload(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = ["--set", f"data.gsm8k_source={ROOT / 'tests' / 'fixtures' / 'gsm8k'}", "--set", "tracking.enabled=false"]
    for stage in ("prepare", "sft"):
        subprocess.run([sys.executable, "-m", "pipeline", stage, "--params", str(ROOT / "configs" / "smoke.yaml"),
                        *sets], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=600)
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "greedy_eval.py"), "--params",
                          str(ROOT / "configs" / "smoke.yaml"), "--limit", "6", "--batch", "4", "2",
                          "--repeats", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "greedy_eval" and out["budget"] == 16  # the smoke params' evaluate.max_new_tokens
    cells = {(w["task"], w["batch"]) for w in out["workloads"]}
    assert cells == {("gsm8k", 4), ("gsm8k", 2), ("arith", 4), ("arith", 2)}
    for w in out["workloads"]:
        assert w["same_completions"] is True and 0 < w["useful_row_steps"] <= 1
        assert len(w["every_row_s"]) == len(w["compacted_s"]) == 2
        assert 0 < w["speedup"]["min"] <= w["speedup"]["median"] <= w["speedup"]["max"]
