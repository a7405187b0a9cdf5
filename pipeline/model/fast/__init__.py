"""One switch for the optimisations that change speed, not results.

Each optimised call site keeps the plain computation beside it, written first, and takes the
fast one only while :func:`enabled` is true (the default). ``with plain():`` runs the plain
path everywhere, so one equivalence test can run the same work both ways
(tests/test_fastpaths.py) besides the per-site tests. The sites:

- rollout decode on CPU fp32: linear weights packed once for MKL (``pipeline.model.fast.packed``);
- token draws: one uniform per row through a blocked inverse CDF instead of ``torch.multinomial``
  (the same distribution, other draws);
- decoding G samples per prompt: the prompt's keys read once per group instead of G copies
  (both backends' decoders), and a transformers ``StaticCache`` where the model supports one;
- decode steps of HF Llama/Qwen2 and of the from-scratch GPT: one flat function with fused q/k/v
  and gate/up weights instead of the model's modules (``pipeline.model.fast.fused_decode``);
- finished rows leave the decode loop: with one row per prompt any row that has stopped, with G
  rows per prompt a group once all its rows have stopped, so later steps compute only the rows
  still decoding; sampled rows keep their own uniforms, so on CPU fp32 at one thread the draws and
  log-probs are the same bits (``pipeline.rl.rollout``, the decoders' ``select``);
- GRPO log-prob passes: each group's shared prompt run once (``Policy.token_logprobs``);
- GRPO's old log-probs with several optimizer steps per rollout batch: the rollout's recorded ones in
  fp32 instead of another forward pass (``pipeline.rl.update.reuses_sampled_logprobs``);
- log p(target): a fused backward instead of autograd's graph of log-softmax and gather.
- transformers models with a tanh-approximate GELU written as a Python formula (GPT-2's ``gelu_new``,
  ``gelu_fast``, ``gelu_accurate``, ``gelu_python_tanh``): one ``F.gelu(approximate="tanh")`` op,
  forward and backward (``pipeline.model.hf``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_enabled = True


def enabled() -> bool:
    """Whether the fast paths are on (they are unless inside :func:`plain`)."""
    return _enabled


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Within the block every site takes its plain path."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved
