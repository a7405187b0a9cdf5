"""bench/onednn.py: inside `onednn_linears` the pipeline's linear layers really run on oneDNN (forward
and backward), give MKL's values to fp32 rounding, and everything is put back afterwards; inside
`mkl_packed` the pipeline's packed weights are MKL's, and oneDNN's again after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pipeline.model.fast.packed as packed_module
from bench.onednn import mkl_packed, onednn_linear_available, onednn_linears
from pipeline.model.fast.packed import MKLWeight, OneDNNWeight, mkl_available

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this torch build")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _step(layer: torch.nn.Linear, x: torch.Tensor):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def test_linear_layers_run_on_onednn_with_mkls_values_and_grads():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(48, 40), torch.randn(3, 7, 48)
    ref = _step(layer, x)
    original, packed_weight = F.linear, packed_module.PackedWeight
    with onednn_linears() as on, _Ops() as ops:
        assert on
        got = _step(layer, x)
        with torch.no_grad():
            no_grad = layer(x)
    assert ops.names.count("_linear_pointwise") == 3  # forward, input gradient, the no-grad call
    for a, b in zip(ref, got):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert torch.allclose(no_grad, ref[0], atol=1e-5, rtol=1e-5)
    assert F.linear is original and packed_module.PackedWeight is packed_weight


def test_packed_weights_are_onednns_and_mkls_inside_mkl_packed_only():
    w, b, x = torch.randn(24, 16), torch.randn(24), torch.randn(5, 16)
    with onednn_linears():
        inside = packed_module.PackedWeight(w, b, 5)
    assert isinstance(inside, OneDNNWeight)
    assert torch.allclose(inside(x), x @ w.t() + b, atol=1e-5)
    assert torch.allclose(inside(x[:2]), x[:2] @ w.t() + b, atol=1e-5)  # another row count, the same copy
    assert isinstance(packed_module.PackedWeight(w, b, 5), OneDNNWeight)  # the pipeline's own choice
    if mkl_available():
        with mkl_packed() as on:
            assert on
            mkl = packed_module.PackedWeight(w, b, 5)
        assert isinstance(mkl, MKLWeight)
        assert torch.allclose(mkl(x), x @ w.t() + b, atol=1e-5)
        assert isinstance(packed_module.PackedWeight(w, b, 5), OneDNNWeight)


def test_other_dtypes_and_autocast_keep_torchs_own_linear():
    w, x = torch.randn(8, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with onednn_linears(), _Ops() as ops:
        F.linear(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(x.float(), w.float())
    assert "_linear_pointwise" not in ops.names
