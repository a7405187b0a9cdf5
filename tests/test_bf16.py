"""bf16 autocast on CPU (`model.dtype: bfloat16`, fp32 master weights) against fp32 on the smoke
warmup: the per-iteration reward and KL stay within a stated tolerance."""

from __future__ import annotations

import pytest

from tests.conftest import smoke_cfg

REWARD_TOL = 0.25  # mean reward of a 3-iteration run, rewards in [0, 1]: sampling diverges under bf16
KL_TOL = 0.02  # per-iteration KL to the reference (0 at the first iteration on both)


def _parity_reward(source):
    """A deterministic verifier stand-in with variance for a random policy: odd-length texts score 1."""
    return lambda text, gold: float(len(text) % 2)


def _run(workdir, dtype: str) -> list[dict[str, float]]:
    from pipeline.stages.grpo import run_grpo

    run_grpo(smoke_cfg("warmup.iterations=3", f"model.dtype={dtype}"), "warmup", verifier=_parity_reward)
    lines = (workdir / "plots" / "warmup.csv").read_text().splitlines()
    return [{k: float(v) for k, v in zip(lines[0].split(","), line.split(",")) if k in ("reward", "kl")}
            for line in lines[1:]]


@pytest.mark.slow
def test_bf16_rewards_and_kl_stay_near_fp32(grpo_workdir):
    fp32, bf16 = _run(grpo_workdir, "float32"), _run(grpo_workdir, "bfloat16")
    assert len(fp32) == len(bf16) == 3
    assert fp32 != bf16  # bf16 really ran: its rounding moves the figures
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert abs(mean(fp32, "reward") - mean(bf16, "reward")) <= REWARD_TOL, (fp32, bf16)
    for a, b in zip(fp32, bf16):
        assert abs(a["kl"] - b["kl"]) <= KL_TOL, (fp32, bf16)
