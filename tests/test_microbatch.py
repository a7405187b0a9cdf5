"""Micro-batched GRPO update: gradients accumulated over micro-batches of rows equal the gradient
of one pass over the whole minibatch (fp64, to 1e-7), for every loss aggregation and importance
mode, micro-batch sizes that divide G, are multiples of it, or neither (sizes that are not multiples
of G take the plain log-prob path for some rows; the plain and shared-prompt paths agree to ~4e-9 in
fp64 themselves, hence 1e-7, inside 1e-6), with the old log-probs taken from the policy (ratio 1) or
recorded at sampling time (ratios away from 1, so the clip binds and each micro-batch must read its
own rows of them)."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.config import GRPOConfig
from pipeline.rl.loss import group_advantages
from pipeline.rl.rollout import rollout_prompts
from pipeline.rl.update import Batch, accumulate_gradients, micro_batches, micro_logprobs, own_width
from tests.conftest import tiny_model_config

PROMPTS = ["Question: What is 3 + 4?\nAnswer:", "Question: What is 12 - 5?\nAnswer:", "Question: 7 + 1?\nAnswer:"]
G = 4


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    policy = build_policy(tiny_model_config(), tiny_tokenizer)
    policy.module.double()
    policy.eval()
    ro = rollout_prompts(policy, PROMPTS, G, 10, generator=torch.Generator().manual_seed(3))
    assert len(set(ro.response_lengths.tolist())) > 1  # ragged responses: token counts differ per row
    rewards = torch.arange(ro.input_ids.shape[0], dtype=torch.float64) % 3
    with torch.no_grad():
        lp = policy.token_logprobs(ro.input_ids, ro.attention_mask, start=ro.prompt_len, group_size=G)
    ref = lp - 0.05 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype)
    old = lp - 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=lp.dtype)
    adv = group_advantages(rewards, G)
    batch = Batch(ro.input_ids, ro.attention_mask, ro.response_mask, adv, None, ref * ro.response_mask,
                  ro.prompt_len)
    recorded = Batch(ro.input_ids, ro.attention_mask, ro.response_mask, adv, old * ro.response_mask,
                     ref * ro.response_mask, ro.prompt_len)
    return policy, batch, recorded


def _grad(policy, g, batch):
    policy.module.zero_grad(set_to_none=True)
    loss, stats = accumulate_gradients(policy, g, batch, slice(0, batch.input_ids.shape[0]))
    return loss, stats, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("old", ["policy", "recorded"])
def test_micro_batches_give_the_one_batch_gradient(setup, loss_agg, importance, old):
    policy, plain, recorded = setup
    batch = recorded if old == "recorded" else plain
    clip = 0.02 if importance == "sequence" else 0.2  # a sequence's ratio averages its tokens' noise
    base = GRPOConfig(group_size=G, kl_coef=0.04, clip=clip, loss_agg=loss_agg, importance=importance)
    loss0, stats0, want = _grad(policy, base, batch)
    assert sum(float(w.abs().sum()) for w in want) > 0
    if old == "recorded":  # the ratios are away from 1: the clip binds on some tokens
        assert float(stats0["clipfrac"]) > 0.1
    for size in (2, 5, 8):  # divides G, neither, a multiple of G
        g = GRPOConfig(group_size=G, kl_coef=0.04, clip=clip, loss_agg=loss_agg, importance=importance,
                       micro_batch_size=size)
        loss, stats, got = _grad(policy, g, batch)
        torch.testing.assert_close(loss, loss0, atol=1e-10, rtol=0)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
        if loss_agg == "token-mean":  # token-weighted statistics are exact too
            torch.testing.assert_close(stats["kl"], stats0["kl"], atol=1e-10, rtol=0)


def test_own_width_ends_at_the_last_column_any_row_attends():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 0, 0]])
    assert own_width(mask) == 5
    assert own_width(mask[:1]) == 4
    assert own_width(torch.ones(2, 3, dtype=torch.long)) == 3
    assert own_width(torch.zeros(2, 3, dtype=torch.long)) == 3  # no column attended: nothing to cut


def test_micro_batch_log_probs_over_their_own_width_are_the_full_width_ones(any_policy):
    """Every backend: the rows of the shortest group, passed at their own width, get the log-probs and
    the gradients of the full-width pass (the shared-prompt path and the plain one), and the policy
    is really called narrower."""
    policy = any_policy
    policy.module.double()
    policy.eval()
    ro = rollout_prompts(policy, PROMPTS, G, 12, stop_ids=[], generator=torch.Generator().manual_seed(5))
    # the first group's rows stopped after 3, 5, 4 and 2 tokens (pads after them), the batch runs to 12
    ids, attn = ro.input_ids[:G].clone(), ro.attention_mask[:G].clone()
    for row, n in enumerate((3, 5, 4, 2)):
        ids[row, ro.prompt_len + n:] = policy.tokenizer.pad_id
        attn[row, ro.prompt_len + n:] = 0
    widths = []
    real = policy.token_logprobs

    def spy(input_ids, *a, **k):
        widths.append(input_ids.shape[1])
        return real(input_ids, *a, **k)

    for group in (G, 1):  # the shared-prompt path, then every row's own prompt
        policy.module.zero_grad(set_to_none=True)
        want = real(ids, attn, start=ro.prompt_len, group_size=group)
        want.sum().backward()
        want_grads = [p.grad.clone() for p in policy.parameters()]
        policy.module.zero_grad(set_to_none=True)
        policy.token_logprobs = spy
        try:
            got = micro_logprobs(policy, ids, attn, 1.0, ro.prompt_len, group)
        finally:
            del policy.token_logprobs
        assert widths[-1] == ro.prompt_len + 5 < ids.shape[1] == ro.prompt_len + 12
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        got.sum().backward()
        for a, b in zip((p.grad for p in policy.parameters()), want_grads):  # the module docstring's 1e-7 bound
            torch.testing.assert_close(a, b, atol=1e-8, rtol=0)


def test_micro_batches_cover_the_rows_once():
    assert micro_batches(slice(4, 15), 4) == [slice(4, 8), slice(8, 12), slice(12, 15)]
    assert micro_batches(slice(0, 6), 0) == [slice(0, 6)]


@pytest.mark.slow
def test_micro_batches_under_torch_compile_give_the_one_batch_gradient(setup):
    """`model.compile` with micro-batches: the runner is torch.compile's wrapper, which has no DDP
    `no_sync` (it once raised AttributeError on the first micro-batch). The wrapper is the real
    OptimizedModule (dynamo traces every call; the eager backend spares the test Inductor's minutes)."""
    import copy
    import dataclasses

    policy, _, batch = setup
    g = GRPOConfig(group_size=G, kl_coef=0.04, micro_batch_size=4)
    _, _, want = _grad(policy, g, batch)
    compiled = copy.copy(policy)
    compiled.model_cfg = dataclasses.replace(policy.model_cfg, compile=True)  # bucketed widths, as configured
    compiled.runner = torch.compile(policy.module, backend="eager")
    assert compiled.runner is not compiled.module
    torch._dynamo.reset()
    try:
        loss, _, got = _grad(compiled, g, batch)
    finally:
        torch._dynamo.reset()
    assert torch.isfinite(loss)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_micro_batches_under_ddp_all_reduce_once_per_minibatch(setup):
    """Under DDP the micro-batches before the last run forward and backward inside `no_sync`, so the
    minibatch's gradients are all-reduced once (DDP decides at the forward whether the backward
    reduces: a backward alone inside `no_sync` still reduces). Counted with a comm hook on a real
    one-process gloo group; the gradient is the one-batch gradient all the same. Also: `no_sync`
    reaches DDP under a torch.compile wrapper."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    policy, batch, _ = setup
    g1 = GRPOConfig(group_size=G, kl_coef=0.04)
    g3 = GRPOConfig(group_size=G, kl_coef=0.04, micro_batch_size=4)  # 12 rows: 3 micro-batches
    _, _, want = _grad(policy, g1, batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = copy.copy(policy)
        wrapped.module = copy.deepcopy(policy.module)
        ddp = DDP(wrapped.module)
        wrapped.runner = ddp
        calls = []

        def count(state, bucket):  # an all-reduce of one bucket, counted; world size 1: the sum is itself
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, count)
        _, _, _ = _grad(wrapped, g1, batch)
        once = len(calls)
        assert once >= 1
        calls.clear()
        _, _, got = _grad(wrapped, g3, batch)
        assert len(calls) == once  # not 3x: the first two micro-batches did not reduce
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=0)

        wrapped.runner = torch.compile(ddp, backend="eager")
        with wrapped.no_sync():
            assert ddp.require_backward_grad_sync is False
        assert ddp.require_backward_grad_sync is True
        wrapped.runner = wrapped.module
        with wrapped.no_sync():  # no DDP: nothing to hold back
            assert ddp.require_backward_grad_sync is True
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
