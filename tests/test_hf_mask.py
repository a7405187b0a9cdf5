"""The full forward and the prompt prefills of a transformers policy give every query at least its
own key (pipeline.model.hf_mask.self_attending_mask, as pipeline.model.hf calls it): with left
padding, the causal-and-padding mask transformers builds from a 2-D mask leaves the pads' queries
with no key, and an attention kernel that does not special-case an empty row (a softmax over a row
of -inf) returns NaN there, which the next layer spreads to the real positions. Here such a kernel
stands in for torch's SDPA: with the 2-D mask the log-probs come out NaN, with the policy's mask
finite and equal, with their gradients, to those of torch's own SDPA, and rollouts sample the same
tokens; and at real positions the policy's mask gives what the 2-D mask gives."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.hf_mask import self_attending_mask
from pipeline.model.policy import build_policy
from tests.conftest import tiny_model_config


def softmax_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 **kwargs):
    """Attention as its textbook formula: an entirely masked row gives 0/0 = NaN."""
    if enable_gqa:
        r = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(r, dim=-3), value.repeat_interleave(r, dim=-3)
    scores = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    T, S = scores.shape[-2:]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=scores.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return scores.softmax(-1) @ value


def left_padded(vocab: int, rows: int = 4, width: int = 24):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : 3 * i] = 0  # row 0 unpadded, the others left-padded by 3, 6, 9 columns
    return ids, mask


def logprobs_and_grads(policy, ids, mask, start: int):
    policy.module.zero_grad(set_to_none=True)
    lp = policy.token_logprobs(ids, mask, start=start)
    (lp * mask).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in policy.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_left_pads_give_finite_logprobs_and_gradients_under_a_kernel_without_empty_row_handling(
        kind, hf_dirs, monkeypatch):
    torch.manual_seed(0)
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    assert policy.module.config._attn_implementation == "sdpa"
    ids, mask = left_padded(policy.tokenizer.vocab_size)
    want_lp, want_g = logprobs_and_grads(policy, ids, mask, start=12)  # torch's SDPA

    monkeypatch.setattr(F, "scaled_dot_product_attention", softmax_sdpa)
    lp, g = logprobs_and_grads(policy, ids, mask, start=12)
    assert torch.isfinite(lp).all() and all(torch.isfinite(t).all() for t in g.values())
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    for name, t in want_g.items():
        torch.testing.assert_close(g[name], t, atol=1e-5, rtol=1e-4)

    # the 2-D mask as transformers takes it: the pads' empty rows turn the padded rows' log-probs to NaN
    monkeypatch.setattr("pipeline.model.hf.self_attending_mask", lambda model, m: m)
    lp, _ = logprobs_and_grads(policy, ids, mask, start=12)
    assert not torch.isfinite(lp[1:]).all()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_real_positions_get_what_the_2d_mask_gives(kind, hf_dirs, monkeypatch):
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    ids, mask = left_padded(policy.tokenizer.vocab_size, rows=5)
    mask[4] = 0  # a row of pads only
    with torch.no_grad():
        ours = policy.logits(ids, mask)
        monkeypatch.setattr("pipeline.model.hf.self_attending_mask", lambda model, m: m)
        theirs = policy.logits(ids, mask)  # torch's SDPA on transformers' mask from the 2-D one
    real = mask.bool()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-6, rtol=0)


def test_the_mask_sees_real_keys_causally_and_each_query_itself(hf_dirs):
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    got = self_attending_mask(policy.module, mask)
    assert got.shape == (2, 1, 4, 4) and got.dtype == torch.bool
    want = torch.tensor([[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]],  # pads see themselves only
                         [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    assert torch.equal(got[:, 0], want)


def test_the_2d_mask_is_kept_without_left_padding_or_for_other_attention(hf_dirs):
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    right_padded = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert self_attending_mask(policy.module, right_padded) is right_padded
    left_padded_mask = torch.tensor([[0, 1, 1, 1]])
    policy.module.config._attn_implementation = "eager"  # wants an additive float mask: transformers builds it
    try:
        assert self_attending_mask(policy.module, left_padded_mask) is left_padded_mask
    finally:
        policy.module.config._attn_implementation = "sdpa"
    # under torch.compile's wrapper the module's config is read through it, and the mask is 4-D even
    # without padding (one mask dtype: no recompile between padded and unpadded batches)
    wrapped = torch.compile(policy.module, backend="eager")
    assert self_attending_mask(wrapped, left_padded_mask).shape == (1, 1, 4, 4)
    assert self_attending_mask(wrapped, torch.ones(2, 4, dtype=torch.long)).shape == (2, 1, 4, 4)


def test_a_compiled_model_without_the_mask_is_warned_about_once(hf_dirs, caplog, monkeypatch):
    import pipeline.model.hf_mask as hf_mask

    monkeypatch.setattr(hf_mask, "_warned_2d_mask", [])
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    policy.module.config._attn_implementation = "eager"
    wrapped = torch.compile(policy.module, backend="eager")
    left = torch.tensor([[0, 1, 1, 1]])
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline.model.hf_mask"):
            assert self_attending_mask(wrapped, left) is left
            assert self_attending_mask(wrapped, left) is left
    finally:
        policy.module.config._attn_implementation = "sdpa"
    warned = [r for r in caplog.records if "model.compile" in r.getMessage()]
    assert len(warned) == 1 and "llama with eager attention" in warned[0].getMessage()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_rollouts_and_shared_prompt_passes_do_not_need_the_kernel_to_zero_empty_rows(kind, hf_dirs, monkeypatch):
    """The eager prompt prefills (the rollout decoder's and the shared-prompt log-prob pass's) give the
    prompts the same mask: with the textbook kernel a rollout of left-padded prompts samples the same
    tokens with the same log-probs as with torch's SDPA, and the shared-prompt pass gives the same
    log-probs; with the 2-D mask the padded prompts' rows sample with NaN log-probs (which the GRPO
    stage refuses)."""
    from pipeline.rl.rollout import rollout_prompts

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    V = policy.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (3, 7, 11)]  # left-padded by 8, 4, 0

    def roll():
        r = rollout_prompts(policy, None, 2, 6, generator=torch.Generator().manual_seed(1), stop_ids=[],
                            prompt_ids=prompts)
        with torch.no_grad():
            shared = policy.token_logprobs(r.input_ids, r.attention_mask, start=r.prompt_len, group_size=2)
        return r, shared

    want, want_shared = roll()
    monkeypatch.setattr(F, "scaled_dot_product_attention", softmax_sdpa)
    got, got_shared = roll()
    assert torch.equal(got.input_ids, want.input_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert torch.isfinite(got_shared).all()
    torch.testing.assert_close(got_shared, want_shared, atol=1e-5, rtol=0)

    monkeypatch.setattr("pipeline.model.hf.self_attending_mask", lambda model, m: m)
    r, shared = roll()
    assert torch.isnan(r.logprobs[:4]).any() and torch.isnan(shared[:4]).any()  # the two padded prompts' rows
    assert torch.isfinite(r.logprobs[4:]).all()  # the unpadded prompt's rows
