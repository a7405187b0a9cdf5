"""The measuring helpers of bench/common.py: paired ratios and the op counter."""

import torch

from bench.common import count_aten_ops, pair_ratios


def test_pair_ratios_pair_runs_taken_back_to_back():
    times = {"slow": [2.0, 9.0, 3.0], "fast": [1.0, 3.0, 2.0]}  # ratios 2, 3, 1.5
    assert pair_ratios(times, "slow", "fast") == {"min": 1.5, "median": 2.0, "max": 3.0}


def test_count_aten_ops_counts_each_dispatched_op():
    x = torch.ones(4)
    assert count_aten_ops(lambda: x + 1) == 1
    assert count_aten_ops(lambda: (x * 2).sum() + x.exp().sum()) == 5
