"""Pre-packed weights for the linear layers of a decode loop on CPU (oneDNN's or MKL's GEMM).

``torch.nn.functional.linear`` on CPU calls MKL's ``sgemm``, which re-packs the weight matrix into
its blocked layout on every call. A decode step multiplies only N rows (the rollout's batch) by each
weight, so that re-packing is a large part of each matmul. During a rollout the weights do not
change, so :func:`packed_linears` packs every fp32 ``nn.Linear`` weight once and routes the layers'
calls through the packed copy until the block ends; the fused decode step
(``pipeline.model.fast.fused_decode``) packs its fused weights the same way (:func:`PackedWeight`).

Which GEMM: oneDNN's (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
Inductor's CPU weight freezing calls) where this torch build has it, else MKL's packed sgemm
(``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``). At the decode rows oneDNN is the
faster: 1.66x MKL's packed GEMM over a 30 x 576 Llama's decode matmuls on ``cpu-avx512``
(``bench/rollout.py --init``, ``onednn_floor_speedup``); docs/results/rollout.md.

- Another order of float sums than ``F.linear`` (MKL) where the inner dimension is over 128 (the last
  bits, ~1e-5 relative); the same bits at 128 or less. Deterministic, and a row's product does not
  depend on how many rows the call has (oneDNN at any count; MKL from 64 rows up), which is what lets
  finished rows leave the decode batch without changing the others' bits.
- Inference only: a call with grad enabled on a weight that requires grad, a non-fp32 input, or
  an input on another device falls back to the layer's own forward.
- A no-op where it does not apply: neither library in this torch build (e.g. ARM without oneDNN), a
  non-CPU or non-fp32 model, or autocast in use (``model.dtype: bfloat16`` on CPU).
- ``transformers``' GPT-2 ``Conv1D`` (a linear layer with a transposed weight) is packed as well.
- Memory: the packed copies live for the block, about the size of the linear weights again.

Measured in ``bench/rollout.py`` (``packed_linear_speedup``, ``onednn_decode_speedup``); see
docs/results/rollout.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def mkl_available() -> bool:
    """Whether this torch build has MKL's packed linear ops."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        return callable(torch.ops.mkl._mkl_reorder_linear_weight) and callable(torch.ops.mkl._mkl_linear)
    except (AttributeError, RuntimeError):
        return False


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's pre-packed linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return callable(torch.ops.mkldnn._reorder_linear_weight) and callable(torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def library() -> str | None:
    """The GEMM the packed weights run on: ``"onednn"``, else ``"mkl"``, else None (nothing packs)."""
    return "onednn" if onednn_available() else "mkl" if mkl_available() else None


def available() -> bool:
    """Whether this torch build can pack linear weights at all (oneDNN or MKL)."""
    return library() is not None


class MKLWeight:
    """``x @ weight.T + bias`` on MKL's packed copy of `weight` (out, in; contiguous fp32) for
    `rows`-row inputs. Fewer rows than the count packed for (finished rows left a decode batch) pack
    it again for the new count, as the packed op takes only that count; more rows than the first
    count (a prefill) run MKL's plain GEMM on the original weight inside the same op."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.weight, self.bias = weight, bias
        self.rows = self.most = rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows != self.rows and rows <= self.most:
            self.rows, self.packed = rows, torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


class OneDNNWeight:
    """``x @ weight.T + bias`` on oneDNN's copy of `weight` (out, in; contiguous fp32) packed once for
    `rows`-row inputs (a hint for the blocking): any row count runs on that one copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, max(1, rows))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def PackedWeight(weight: torch.Tensor, bias: torch.Tensor | None, rows: int):  # noqa: N802 (a factory)
    """`weight` packed for `rows`-row inputs on :func:`library`'s GEMM (:class:`OneDNNWeight` or
    :class:`MKLWeight`); callable as ``packed(x)``. Shared by the module path
    (:func:`packed_linears`) and the fused decode step."""
    return OneDNNWeight(weight, bias, rows) if library() == "onednn" else MKLWeight(weight, bias, rows)


class _PackedLinear:
    """A replacement ``forward`` for one layer: :class:`PackedWeight` where it applies, else the
    layer's own forward."""

    def __init__(self, layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.layer = layer
        self.original = type(layer).forward
        self.linear = PackedWeight(weight, bias, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and any(p.requires_grad for p in self.layer.parameters(False)))):
            return self.original(self.layer, x)
        return self.linear(x)


def _packable(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight as (out, in), bias) of a linear layer we know how to pack, else None."""
    if isinstance(layer, nn.Linear):
        weight, bias = layer.weight, layer.bias
    elif type(layer).__name__ == "Conv1D" and hasattr(layer, "nf") and hasattr(layer, "weight"):
        weight, bias = layer.weight.t(), layer.bias  # transformers' Conv1D: x @ weight (in, out) + bias
    else:
        return None
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None
    return weight.detach().contiguous(), None if bias is None else bias.detach()


@contextlib.contextmanager
def packed_linears(module: nn.Module, rows: int, enabled: bool = True) -> Iterator[int]:
    """Within the block, every packable linear layer of `module` runs on weights packed for
    `rows`-row inputs (:func:`PackedWeight`: oneDNN's copy serves any row count; MKL's is packed again
    for a smaller count, and a call with more rows, a prefill, runs MKL's plain GEMM inside the same
    op). Yields how many layers were packed (0 where it does not apply). The weights must not change
    inside the block."""
    if not enabled or rows < 1 or not available():
        yield 0
        return
    patched: list[nn.Module] = []
    try:
        for layer in module.modules():
            if "forward" in layer.__dict__:  # already patched (nested use) or a custom forward
                continue
            found = _packable(layer)
            if found is None:
                continue
            layer.forward = _PackedLinear(layer, found[0], found[1], rows)
            patched.append(layer)
        yield len(patched)
    finally:
        for layer in patched:
            del layer.forward


__all__ = ["MKLWeight", "OneDNNWeight", "PackedWeight", "available", "library", "packed_linears"]
