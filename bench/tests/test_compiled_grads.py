"""bench/compiled_grads.py end to end: a real torch.compile wrapper (dynamo with the eager backend,
so no Inductor minutes) of the from-scratch GPT on left-padded rows gives finite gradients equal to
eager ones, and the JSON line says so; a non-finite gradient would be named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_compiled_grads_reports_finite_equal_gradients():
    out = subprocess.run([sys.executable, "bench/compiled_grads.py", "gpt", "--backend", "eager", "--device", "cpu",
                          "--rows", "4", "--width", "40", "--start", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["eager"] == {"logprobs_finite": True, "nonfinite_grads": []}
    assert res["compiled"] == {"logprobs_finite": True, "nonfinite_grads": []}
    assert res["max_logprob_diff"] < 1e-5 and res["max_rel_grad_diff"] < 1e-5


@pytest.mark.slow
def test_compiled_grads_refuses_padding_past_the_prompt():
    out = subprocess.run([sys.executable, "bench/compiled_grads.py", "gpt", "--rows", "8", "--start", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--start must exceed" in out.stderr


@pytest.mark.slow
def test_compiled_grads_runs_a_transformers_model_with_either_mask(tmp_path):
    model = tmp_path / "qwen2"
    subprocess.run([sys.executable, "bench/tiny_instruct.py", str(model), "--layers", "2", "--width", "64",
                    "--heads", "4", "--kv-heads", "2", "--vocab", "2048", "--gsm8k", "tests/fixtures/gsm8k"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    for mask in ("2d", "policy"):
        out = subprocess.run([sys.executable, "bench/compiled_grads.py", str(model), "--backend", "eager",
                              "--device", "cpu", "--rows", "4", "--width", "40", "--start", "20", "--pad-step", "3",
                              "--mask", mask], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        ndim = 2 if mask == "2d" else 4
        assert f"left padding 0..9, mask {mask} ({ndim}-D)" in out.stdout
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert (res["mask"], res["mask_ndim"], res["pad_step"]) == (mask, ndim, 3)
        assert res["compiled"] == {"logprobs_finite": True, "nonfinite_grads": []}
        assert res["max_logprob_diff"] < 1e-5 and res["max_rel_grad_diff"] < 1e-5


@pytest.mark.slow
def test_compiled_grads_refuses_a_negative_pad_step():
    out = subprocess.run([sys.executable, "bench/compiled_grads.py", "gpt", "--pad-step", "-1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pad_step be >= 0" in out.stderr
