"""bench/rollout.py's floor (`weight_matmuls_only`) does exactly the rollout's weight matmuls: the same
FLOPs as our engine's linear layers over a whole rollout (the prefill's and every decode step's),
counted op by op, so `floor_ratio` bounds what an fp32 engine doing that arithmetic could reach."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.rollout import build, on_mkl, weight_matmuls_only
from pipeline.model.fast.packed import mkl_available
from pipeline.rl.rollout import rollout_prompts


class _LinearFlops(TorchDispatchMode):
    """FLOPs of the weight matmuls dispatched: MKL's packed linear, oneDNN's, and the mm/addmm a
    plain linear becomes (attention's batched matmuls are bmm/baddbmm, not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_mkl_linear":
            x, w = args[0], args[2]  # (..., K) input, (N, K) original weight
            self.flops += 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
        elif name == "_linear_pointwise":
            x, w = args[0], args[1]  # (..., K) input, (N, K) weight in oneDNN's packed layout
            self.flops += 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
        elif name in ("mm", "addmm"):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def _flops(fn) -> int:
    with _LinearFlops() as mode:
        fn()
    return mode.flops


@pytest.mark.slow  # the bench's model builder trains a 2048-token BPE first
def test_the_floor_does_the_rollouts_weight_matmuls_and_nothing_else():
    torch.set_num_threads(1)
    prompts, group, prompt_len, new = 2, 3, 5, 4
    hf_policy, _, vocab = build(2, 64, 4)
    prompt_ids = torch.randint(10, vocab, (prompts, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()

    def ours():
        r = rollout_prompts(hf_policy, None, group, new, generator=torch.Generator().manual_seed(1), stop_ids=[],
                            prompt_ids=prompt_ids)
        assert int(r.response_lengths.sum()) == prompts * group * new

    llama = hf_policy.module
    got = _flops(ours)
    floor = _flops(weight_matmuls_only(llama, prompts, prompt_len, prompts * group, new))
    # by hand: 2 x params of the layers per prompt token, of layers and head per decode row-step
    per_layer = sum(m.weight.numel() for layer in llama.model.layers for m in layer.modules()
                    if isinstance(m, torch.nn.Linear))
    head = llama.lm_head.weight.numel()
    expected = 2 * (prompts * prompt_len * per_layer + prompts * head + (new - 1) * prompts * group * (per_layer + head))
    assert got == floor == expected
    if mkl_available():  # the MKL floor and A/B arm: the same matmuls on the other GEMM
        assert _flops(weight_matmuls_only(llama, prompts, prompt_len, prompts * group, new, "mkl")) == expected
        assert _flops(on_mkl(ours)) == expected


@pytest.mark.slow
def test_step_breakdown_splits_the_fused_steps_time_and_puts_everything_back():
    """`step_breakdown`: the weight matmuls, the attention and the rest of each decode step add up to
    the step; the timers are removed afterwards (the same functions and the policy's own decoder)."""
    import pipeline.model.fast.fused_decode as fused_decode
    from bench.rollout import step_breakdown

    torch.set_num_threads(1)
    hf_policy, _, vocab = build(2, 64, 4)
    prompt_ids = torch.randint(10, vocab, (2, 5), generator=torch.Generator().manual_seed(0)).tolist()
    linear, attention = fused_decode._Linear.__call__, fused_decode.grouped_prefix_attention

    def run():
        rollout_prompts(hf_policy, None, 3, 6, generator=torch.Generator().manual_seed(1), stop_ids=[],
                        prompt_ids=prompt_ids)

    b = step_breakdown(hf_policy, run)
    assert b["step_ms"] > 0 and all(0 < b[k] < 1 for k in ("linears", "attention", "rest"))
    assert abs(b["linears"] + b["attention"] + b["rest"] - 1) < 1e-9
    assert fused_decode._Linear.__call__ is linear and fused_decode.grouped_prefix_attention is attention
    assert "decoder" not in hf_policy.__dict__
    with pytest.raises(RuntimeError, match="fused decode step"):  # a rollout that never decodes
        step_breakdown(hf_policy, lambda: None)
