"""Pre-packed weights for the linear layers of a decode loop on CPU (MKL's packed sgemm).

``torch.nn.functional.linear`` on CPU calls MKL's ``sgemm``, which re-packs the weight matrix into
its blocked layout on every call. A decode step multiplies only N rows (the rollout's batch) by each
weight, so that re-packing is a large part of each matmul. During a rollout the weights do not
change, so :func:`packed_linears` packs every fp32 ``nn.Linear`` weight once
(``torch.ops.mkl._mkl_reorder_linear_weight``, what Inductor's CPU weight freezing uses) and routes
the layers' calls through ``torch.ops.mkl._mkl_linear`` until the block ends.

- The same values as ``F.linear`` (bit-identical at 64 or more rows in our measurements; at fewer
  rows MKL takes another kernel and the last bits can differ); deterministic either way.
- Inference only: a call with grad enabled on a weight that requires grad, a non-fp32 input, or
  an input on another device falls back to the layer's own forward.
- A no-op where it does not apply: no MKL in this torch build (e.g. ARM), a non-CPU or non-fp32
  model, or autocast in use (``model.dtype: bfloat16`` on CPU).
- ``transformers``' GPT-2 ``Conv1D`` (a linear layer with a transposed weight) is packed as well.
- Memory: the packed copies live for the block, about the size of the linear weights again.

Measured in ``bench/rollout.py`` (``packed_linear_speedup``); see docs/results/speed.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def available() -> bool:
    """Whether this torch build has MKL's packed linear ops."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        return callable(torch.ops.mkl._mkl_reorder_linear_weight) and callable(torch.ops.mkl._mkl_linear)
    except (AttributeError, RuntimeError):
        return False


class PackedWeight:
    """``x @ weight.T + bias`` on MKL's packed copy of `weight` (out, in; contiguous fp32) for
    `rows`-row inputs. Fewer rows than the count packed for (finished rows left a decode batch) pack
    it again for the new count, as the packed op takes only that count; more rows than the first
    count (a prefill) run MKL's plain GEMM on the original weight inside the same op. Shared by the
    module path (:func:`packed_linears`) and the fused decode step (``pipeline.model.fused_decode``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        self.weight, self.bias = weight, bias
        self.rows = self.most = rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows != self.rows and rows <= self.most:
            self.rows, self.packed = rows, torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


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
    `rows`-row inputs, packed again for a smaller row count when one comes (a decode batch whose
    finished rows left); a call with more rows (a prefill) runs MKL's plain GEMM inside the same op
    (:class:`PackedWeight`), as MKL's packed GEMM takes only the count it was packed for. Yields how many layers were packed (0 where it does
    not apply). The weights must not change inside the block."""
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


__all__ = ["PackedWeight", "available", "packed_linears"]
