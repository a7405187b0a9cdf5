"""bench/compiled_grads.py end to end: a real torch.compile wrapper (dynamo with the eager backend,
so no Inductor minutes) of the from-scratch GPT on left-padded rows gives finite gradients equal to
eager ones, and the JSON line says so; a non-finite gradient would be named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compiled_grads_reports_finite_equal_gradients():
    out = subprocess.run([sys.executable, "bench/compiled_grads.py", "gpt", "--backend", "eager", "--device", "cpu",
                          "--rows", "4", "--width", "40", "--start", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["eager"] == {"logprobs_finite": True, "nonfinite_grads": []}
    assert res["compiled"] == {"logprobs_finite": True, "nonfinite_grads": []}
    assert res["max_logprob_diff"] < 1e-5 and res["max_rel_grad_diff"] < 1e-5


def test_compiled_grads_refuses_padding_past_the_prompt():
    out = subprocess.run([sys.executable, "bench/compiled_grads.py", "gpt", "--rows", "8", "--start", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--start must exceed" in out.stderr
