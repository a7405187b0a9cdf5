"""bench/grpo_iteration.py reports the optimizer steps the trainer skipped as non-finite: a device check
must tell a run that skipped a step from a clean one (a compiled run stops only at `max_nonfinite`
skips in a row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_skipped_steps_are_printed_and_reported(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import grpo_iteration

    import pipeline.stages.grpo as grpo_stage

    real = grpo_stage.step_if_finite
    calls = []

    def first_step_skipped(optimizer, params, grad_clip, loss):  # as if the first loss were NaN
        calls.append(1)
        if len(calls) == 1:
            optimizer.zero_grad(set_to_none=True)
            return None
        return real(optimizer, params, grad_clip, loss)

    monkeypatch.setattr(grpo_stage, "step_if_finite", first_step_skipped)
    monkeypatch.setattr(grpo_stage, "sample_groups", grpo_stage.sample_groups)  # the bench wraps it: restored after
    monkeypatch.setattr(sys, "argv", ["grpo_iteration.py", "--params", str(ROOT / "configs" / "smoke.yaml"),
                                      "--gsm8k", str(ROOT / "tests" / "fixtures" / "gsm8k"), "--iters", "1"])
    threads = torch.get_num_threads()
    try:
        grpo_iteration.main()
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread
    out = capsys.readouterr().out
    assert len(calls) >= 2  # the warm-up's step and the timed iteration's
    assert "optimizer steps skipped as non-finite (warm-up included): 1" in out
    assert json.loads(out.strip().splitlines()[-1])["skipped_steps"] == 1
