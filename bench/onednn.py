"""The GEMM library as a lever the benches can measure. The pipeline's decode matmuls run on weights
packed for oneDNN (``pipeline.model.fast.packed``); its other fp32 matmuls (the log-prob and update
passes) on MKL through ``F.linear``.

- :func:`onednn_linears`: every fp32 ``F.linear`` on oneDNN too, forward and backward
  (`bench/grpo_iteration.py --ab-onednn`): what oneDNN would give the passes with grad.
- :func:`mkl_packed`: the decode matmuls on MKL's packed GEMM instead, as before oneDNN
  (`bench/rollout.py --levers`, ``ours_hf_mkl``: ``onednn_decode_speedup``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


from pipeline.model.fast.packed import MKLWeight, OneDNNWeight, mkl_available
from pipeline.model.fast.packed import onednn_available as onednn_linear_available


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on oneDNN, the weight packed for this call's row count."""
    return OneDNNWeight(weight, bias, x.numel() // x.shape[-1])(x)


class _OneDNNLinear(torch.autograd.Function):
    """A linear layer with grad: the forward and the input's gradient (grad @ weight, on the
    transposed weight packed for the call) on oneDNN, the weight's (grad.T @ x) and bias's as
    autograd's own ``mm`` and ``sum``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = _linear(grad, weight.t().contiguous(), None) if ctx.needs_input_grad[0] else None
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = g2.t() @ x2 if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _patched_linear(original):
    def linear(x, weight, bias=None):
        if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2
                or torch.is_autocast_enabled("cpu") or x.numel() == 0):
            return original(x, weight, bias)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return _OneDNNLinear.apply(x, weight, bias)
        return _linear(x, weight, bias)
    return linear


@contextlib.contextmanager
def mkl_packed() -> Iterator[bool]:
    """Within the block every weight the pipeline packs (``pipeline.model.fast.packed``: the rollout's) is
    packed for MKL's GEMM instead of oneDNN's. Yields False, changing nothing, where this torch build
    has no MKL packed linear."""
    import pipeline.model.fast.packed as packed_module

    if not mkl_available():
        yield False
        return
    packed_weight = packed_module.PackedWeight
    packed_module.PackedWeight = MKLWeight
    try:
        yield True
    finally:
        packed_module.PackedWeight = packed_weight


@contextlib.contextmanager
def onednn_linears() -> Iterator[bool]:
    """Within the block every fp32 CPU ``F.linear`` (the pipeline's linear layers, forward and
    backward) and every weight the pipeline packs (``pipeline.model.fast.packed``: the rollout's) run on
    oneDNN. Yields False, changing nothing, where this torch build has no oneDNN linear."""
    import pipeline.model.fast.packed as packed_module

    if not onednn_linear_available():
        yield False
        return
    original, packed_weight = F.linear, packed_module.PackedWeight
    F.linear, packed_module.PackedWeight = _patched_linear(original), OneDNNWeight
    try:
        yield True
    finally:
        F.linear, packed_module.PackedWeight = original, packed_weight
