"""Pre-packed linear layers for the CPU decode loop (pipeline/model/fast/packed.py: oneDNN, else MKL)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.fast import packed
from pipeline.model.fast.packed import packed_linears
from pipeline.rl.rollout import rollout_prompts

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch build has no packed linear ops")


def linear_layers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]


@pytest.mark.parametrize("rows", [3, 64, 130])
def test_packed_layers_compute_what_the_layers_compute(any_policy, rows):
    module = any_policy.module
    layers = linear_layers(module)
    assert layers
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in layers:  # HF initialises biases to zero; make them count
            if getattr(layer, "bias", None) is not None:
                layer.bias.normal_()
    inputs = [torch.randn(rows, 1, layer.in_features if hasattr(layer, "in_features") else layer.weight.shape[0])
              for layer in layers]
    with torch.inference_mode():
        expected = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
        with packed_linears(module, rows) as n:
            assert n == len(layers)  # every linear layer (GPT-2's Conv1D included) is packed
            assert all(isinstance(layer.__dict__.get("forward"), packed._PackedLinear) for layer in layers)
            got = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert not any("forward" in layer.__dict__ for layer in layers)  # restored after the block


def test_logits_inside_the_block_equal_the_plain_forward(any_policy):
    ids = torch.randint(4, any_policy.tokenizer.vocab_size, (64, 9))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        expected = any_policy.logits(ids, mask)
        with packed_linears(any_policy.module, 64 * 9):
            got = any_policy.logits(ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_forwards_are_restored_when_the_block_raises(gpt_policy):
    with pytest.raises(RuntimeError, match="boom"), packed_linears(gpt_policy.module, 8) as n:
        assert n > 0
        raise RuntimeError("boom")
    assert not any("forward" in layer.__dict__ for layer in linear_layers(gpt_policy.module))


def test_grad_mode_falls_back_to_the_differentiable_forward(gpt_policy):
    """Inside the block, a call that needs gradients takes the layer's own forward, so backward works
    and gives the same gradient as outside the block."""
    layer = linear_layers(gpt_policy.module)[0]
    x = torch.randn(5, layer.in_features)
    layer.weight.grad = None
    layer(x).square().sum().backward()
    expected = layer.weight.grad.clone()
    layer.weight.grad = None
    with packed_linears(gpt_policy.module, 5):
        out = layer(x)
        assert out.grad_fn is not None
        out.square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, expected)


def test_disabled_or_non_fp32_models_are_left_alone(gpt_policy):
    with packed_linears(gpt_policy.module, 8, enabled=False) as n:
        assert n == 0
        assert not any("forward" in layer.__dict__ for layer in linear_layers(gpt_policy.module))
    bf16 = nn.Linear(4, 3).to(torch.bfloat16)
    with packed_linears(bf16, 8) as n:
        assert n == 0


def test_rollout_with_and_without_packing(any_policy, monkeypatch):
    """The rollout engine packs the weights on CPU; switching it off gives the same greedy tokens
    and the same log-probs up to float rounding."""
    prompts = ["1 + 2 =", "a b c", "7"]
    calls = []
    real = packed_linears

    def spy(module, rows, enabled=True):
        calls.append((rows, enabled))
        return real(module, rows, enabled)

    monkeypatch.setattr("pipeline.rl.rollout.packed_linears", spy)
    on = rollout_prompts(any_policy, prompts, 4, 12, greedy=True)
    monkeypatch.setattr("pipeline.rl.rollout.packed_linears", lambda m, r, enabled=True: real(m, r, False))
    off = rollout_prompts(any_policy, prompts, 4, 12, greedy=True)
    assert calls == [(12, True)]  # 3 prompts x G 4 rows, enabled on a CPU fp32 policy
    assert torch.equal(on.input_ids, off.input_ids)
    torch.testing.assert_close(on.logprobs, off.logprobs, rtol=1e-5, atol=1e-5)
