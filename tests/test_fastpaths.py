"""The fast paths (pipeline.model.fast) against the plain paths, on every backend: the same
greedy completions, log-probs and gradients, the same sampling distribution; and the switch does
switch (the decoders' structure, the draw)."""

from __future__ import annotations

import torch

from pipeline.model import fast
from pipeline.rl.rollout import rollout_prompts, sample_next

PROMPTS = ["Question: What is 3 + 4?\nAnswer:", "Question: 12 - 5?", "Question: What is 99 + 1?\nAnswer: 9"]


def _work(policy):
    """A greedy rollout, the GRPO log-prob pass of a sampled rollout, and that pass's gradient."""
    greedy = rollout_prompts(policy, PROMPTS, group_size=3, max_new_tokens=8, greedy=True, stop_ids=[])
    with fast.plain():  # the same sampled batch for both: plain draws differ from fast ones
        ro = rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=8, generator=torch.Generator().manual_seed(1))
    policy.module.zero_grad()
    lp = policy.token_logprobs(ro.input_ids, ro.attention_mask, 0.7, start=ro.prompt_len, group_size=4)
    (lp * ro.response_mask).sum().backward()
    grads = [p.grad.clone() for p in policy.module.parameters() if p.grad is not None]
    return greedy, lp.detach(), grads


def test_every_fast_path_equals_the_plain_path(any_policy):
    quick = _work(any_policy)
    with fast.plain():
        plain = _work(any_policy)
    assert quick[0].texts == plain[0].texts and torch.equal(quick[0].input_ids, plain[0].input_ids)
    torch.testing.assert_close(quick[0].logprobs, plain[0].logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(quick[1], plain[1], atol=1e-5, rtol=0)
    assert len(quick[2]) == len(plain[2]) > 0
    for a, b in zip(quick[2], plain[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_plain_sampling_draws_from_the_same_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(40_000, 5)
    want = logits[0].double().softmax(-1)
    for plain in (False, True):
        with fast.plain() if plain else torch.no_grad():
            tokens, logp = sample_next(logits, generator=torch.Generator().manual_seed(3))
        freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
        torch.testing.assert_close(freq, want, atol=0.01, rtol=0)
        torch.testing.assert_close(logp, logits.log_softmax(-1)[0, tokens], atol=1e-5, rtol=0)
    fast_tokens, _ = sample_next(logits, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(tokens, fast_tokens)  # the switch changed the draw (multinomial vs inverse CDF)


def test_the_switch_turns_the_decoders_plain(gpt_policy, hf_dirs):
    from pipeline.model.hf import HFDecoder
    from pipeline.model.policy import build_policy
    from tests.conftest import tiny_model_config

    ids = torch.tensor([gpt_policy.tokenizer.encode(PROMPTS[0])])
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1])[None]
    hf = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    for plain in (False, True):
        with fast.plain() if plain else torch.no_grad(), torch.no_grad():
            dec = gpt_policy.decoder(ids.shape[1] + 4).inner
            dec.prefill(ids, mask, pos, 3)
            assert (dec.cache.prefix is None) == plain  # plain: every row holds its own copy of the prompt keys
            assert HFDecoder(hf.module, 16).shared != plain
    assert fast.enabled()


def _tiny_gpt2(activation: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2, activation_function=activation,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def test_the_tanh_gelu_formula_is_one_op_of_the_same_function():
    import copy
    import math

    from transformers import activations

    from pipeline.model.hf import _TanhGELU, fuse_activations

    # the swapped module against the formula in float64, values and gradients, over ordinary and
    # extreme inputs (the exact-erf GELU differs from it by up to ~5e-4 near |x| = 2: caught here)
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-1e4, -1e2, -30.0, 0.0, 30.0, 1e2, 1e4])])
    x64 = x.double().requires_grad_()
    want = 0.5 * x64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    (want_grad,) = torch.autograd.grad(want.sum(), x64)
    formulas = [activations.NewGELUActivation(), activations.FastGELUActivation(),
                activations.AccurateGELUActivation(), activations.GELUTanh(use_gelu_tanh_python=True)]
    for formula in formulas:
        xs = x.clone().requires_grad_()
        got = _TanhGELU(formula)(xs)
        (grad,) = torch.autograd.grad(got.sum(), xs)
        torch.testing.assert_close(got.double(), want.detach(), atol=3e-7, rtol=2e-6)
        torch.testing.assert_close(grad.double(), want_grad, atol=2e-6, rtol=2e-6)

    for activation, swaps in (("gelu_new", 3), ("gelu_fast", 3), ("gelu_accurate", 3), ("gelu_python_tanh", 3),
                              ("gelu_pytorch_tanh", 0), ("gelu", 0), ("relu", 0)):
        model = _tiny_gpt2(activation)
        original = copy.deepcopy(model)
        keys = list(model.state_dict())
        assert fuse_activations(model) == swaps
        assert fuse_activations(model) == 0  # applying it twice swaps none
        assert fuse_activations(copy.deepcopy(model)) == 0  # a deep copy (the reference policy) keeps the swap
        assert sum(isinstance(m, _TanhGELU) for m in model.modules()) == swaps
        assert list(model.state_dict()) == keys and model.config.activation_function == activation
        ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
        outs = []
        for m in (model, original):
            m.zero_grad()
            logits = m(input_ids=ids).logits
            logits.square().mean().backward()
            outs.append((logits.detach(), [p.grad.clone() for p in m.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        with fast.plain(), torch.no_grad():  # the switch runs the formula it replaced: the same bits
            assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)


def test_an_hf_policy_runs_gpt2_gelu_as_one_op(hf_dirs):
    import copy

    from pipeline.model.hf import _TanhGELU, fuse_activations
    from pipeline.model.policy import build_policy
    from tests.conftest import tiny_model_config

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["gpt2"]))
    assert sum(isinstance(m, _TanhGELU) for m in policy.module.modules()) == policy.module.config.n_layer
    assert fuse_activations(copy.deepcopy(policy.module)) == 0  # the reference policy's copy is swapped already
