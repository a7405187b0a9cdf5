"""`model.compile` under LoRA: the adapted policy's forward runs through torch.compile. `add_lora`
replaces the policy's module with peft's wrapper; it once left the runner as that bare wrapper, so
a LoRA run with `model.compile: true` ran eager without a word (fixed in 8a02e5d).

The compiler is dynamo with a counting backend (`CompileCounter`: the captured graphs run as they
are), so the check takes seconds on a CPU instead of Inductor's minutes; which backend compiles
is torch's business, that the forward goes through dynamo is ours."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config

pytest.importorskip("peft")

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=["q_proj", "v_proj"])


@pytest.fixture
def counted_compile(monkeypatch):
    """torch.compile with a backend that counts the frames and ops dynamo hands it."""
    from torch._dynamo.testing import CompileCounter

    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=counter))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_lora_policy_runs_its_forward_through_torch_compile(hf_dirs, counted_compile):
    from pipeline.model.lora import add_lora
    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    cfg = tiny_model_config(backend="hf", init=hf_dirs["llama"], compile=True, **LORA)
    policy = build_policy(cfg)
    add_lora(policy, cfg)
    assert isinstance(policy.runner, torch._dynamo.eval_frame.OptimizedModule)
    assert policy.runner._orig_mod is policy.module  # the adapted module, not the base compiled before it
    for name, p in policy.module.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # adapters that change the logits
    ids = torch.randint(3, policy.tokenizer.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logits = policy.logits(ids, mask)
    assert counted_compile.frame_count > 0 and counted_compile.op_count > 0, "the forward did not go through dynamo"
    with policy.module.disable_adapter():
        base = policy._ops.logits(policy.module, ids, mask, 0)
    assert not torch.allclose(logits, base)  # the compiled forward ran the adapters
    assert torch.allclose(logits, policy._ops.logits(policy.module, ids, mask, 0), atol=1e-5)
