"""bench/grpo_iteration.py reports the optimizer steps the trainer skipped as non-finite: a device check
must tell a run that skipped a step from a clean one (a compiled run stops only at `max_nonfinite`
skips in a row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_full_width_twin_is_timed_beside_the_iteration_and_the_lever_restored(monkeypatch, capsys):
    """--ab-full-width: a twin trainer runs its micro-batches at the batch's width, alternating with the
    iteration, which keeps cutting them to their own; the paired ratios are reported, and the lever is
    back in place afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import grpo_iteration

    import pipeline.rl.update as rl_update
    import pipeline.stages.grpo as grpo_stage

    widths = {"own": 0, "full": 0}
    real = rl_update.own_width

    def counting(mask):
        widths["own"] += 1
        return real(mask)

    monkeypatch.setattr(rl_update, "own_width", counting)
    token_logprobs = grpo_stage.Policy.token_logprobs

    def spy(self, input_ids, *a, **k):  # the twin's passes: every micro-batch at the rollout's full width
        if rl_update.own_width is not counting:
            widths["full"] += 1
        return token_logprobs(self, input_ids, *a, **k)

    monkeypatch.setattr(grpo_stage.Policy, "token_logprobs", spy)
    monkeypatch.setattr(grpo_stage, "sample_groups", grpo_stage.sample_groups)  # the bench wraps it: restored after
    monkeypatch.setattr(sys, "argv", ["grpo_iteration.py", "--params", str(ROOT / "configs" / "smoke.yaml"),
                                      "--gsm8k", str(ROOT / "tests" / "fixtures" / "gsm8k"), "--iters", "1",
                                      "--set", "grpo.micro_batch_size=2", "--ab-full-width"])
    threads = torch.get_num_threads()
    try:
        grpo_iteration.main()
    finally:
        torch.set_num_threads(threads)
    assert rl_update.own_width is counting  # restored after the twin's iterations
    assert widths["own"] > 0 and widths["full"] > 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert set(report["own_width_pairs"]) == {"min", "median", "max"}
    assert len(report["full_width_times"]) == len(report["times"]) == 1
    assert "A/B: micro-batches at the batch's full width" in out
