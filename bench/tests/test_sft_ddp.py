"""bench/sft_ddp.py end to end on the smoke params: both arms run (one process, and two under torchrun),
every round pairs them, and the last line is the JSON the docs quote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sft_ddp_bench_times_both_arms_in_every_round():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "sft_ddp.py"), "--params",
                          str(ROOT / "configs" / "smoke.yaml"), "--gsm8k", str(ROOT / "tests" / "fixtures" / "gsm8k"),
                          "--steps", "2", "--warm-steps", "1", "--repeats", "2"],
                         capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "sft_ddp" and out["nproc"] == 2
    for arm in ("one", "ddp"):
        assert len(out["step_s"][arm]) == len(out["check_s"][arm]) == 2
        assert all(t > 0 for t in out["step_s"][arm] + out["check_s"][arm])
    r = out["step_speedup"]
    assert 0 < r["min"] <= r["median"] <= r["max"]
    assert sum(line.startswith("round ") for line in res.stdout.splitlines()) == 2
