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


def test_shape_peak_takes_the_fastest_gemm_of_any_shape(monkeypatch):
    """The peak is the best FLOP/s of any shape by any library, with the shape and library named."""
    import bench.common as common

    secs = {(64, 128, 384): {"mm": 2e-4, "onednn": 1e-4},  # 31.5 / 62.9 GFLOP/s
            (8, 128, 384): {"mm": 1e-5, "onednn": 2e-5}}  # 78.6 / 39.3 GFLOP/s: the best
    monkeypatch.setattr(common, "_best_mm_seconds_by_library", lambda m, k, n, *a: secs[(m, k, n)])
    peak = common.ShapePeak("float32")
    peak.measure([(384, 128)], [64])
    assert (peak.best_shape, peak.best_library) == ((64, 128, 384), "onednn")
    assert peak.best == 2 * 64 * 128 * 384 / 1e-4
    peak.measure([(384, 128)], [8, 64])
    assert (peak.best_shape, peak.best_library) == ((8, 128, 384), "mm")
    assert peak.best == 2 * 8 * 128 * 384 / 1e-5


def test_every_gemm_timed_computes_the_product():
    """Each library the peak times multiplies the same operands (oneDNN's on the packed transpose):
    against a float64 product, and oneDNN timed wherever this torch build has it."""
    from bench.common import gemms
    from bench.onednn import onednn_linear_available

    a, b = torch.randn(24, 40), torch.randn(40, 56)
    ref = (a.double() @ b.double()).float()
    found = gemms(a, b)
    assert set(found) == ({"mm", "onednn"} if onednn_linear_available() else {"mm"})
    for library, product in found.items():
        assert torch.allclose(product(), ref, atol=1e-4), library
