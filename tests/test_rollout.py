"""The rollout engine over every backend (GPT rope/learned, HF GPT-2/Llama): layout, masks,
stop handling, log-prob agreement with Policy.token_logprobs, padding invariance, reproducibility."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.rl.rollout import left_pad, rollout_prompts, sample_next
from tests.conftest import ROLLOUT_PROMPTS as PROMPTS
from tests.conftest import seeded as gen

def reference_greedy(policy, prompt: str, n: int) -> list[int]:
    """Plain loop: one unpadded sequence, full recomputation each step, no cache."""
    ids = policy.tokenizer.encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids + out])
            out.append(int(policy.logits(x, torch.ones_like(x))[0, -1].argmax()))
    return out


def test_layout_and_group_contiguity(any_policy):
    tok = any_policy.tokenizer
    r = rollout_prompts(any_policy, PROMPTS, group_size=4, max_new_tokens=6, generator=gen(), stop_ids=[])
    N, T = r.input_ids.shape
    assert N == 12 and T == r.prompt_len + 6 and len(r.texts) == 12
    for name in ("attention_mask", "response_mask", "logprobs"):
        assert getattr(r, name).shape == (N, T)
    ids, mask = left_pad([tok.encode(p) for p in PROMPTS], tok.pad_id)
    assert torch.equal(r.input_ids[:, : r.prompt_len], ids.repeat_interleave(4, 0))
    assert torch.equal(r.attention_mask[:, : r.prompt_len], mask.repeat_interleave(4, 0))
    assert r.response_mask[:, r.prompt_len:].all() and not r.response_mask[:, : r.prompt_len].any()
    assert r.truncated.all() and (r.response_lengths == 6).all()
    assert (r.logprobs[:, : r.prompt_len] == 0).all() and (r.logprobs[:, r.prompt_len:] < 0).all()


def test_greedy_matches_plain_reference_loop(any_policy):
    r = rollout_prompts(any_policy, PROMPTS, group_size=2, max_new_tokens=8, greedy=True, stop_ids=[])
    for i, prompt in enumerate(PROMPTS):
        ref = reference_greedy(any_policy, prompt, 8)
        for g in range(2):  # every member of a greedy group is the same
            assert r.input_ids[2 * i + g, r.prompt_len:].tolist() == ref


def test_masks_for_sequences_that_stop_early(any_policy):
    """A third of the vocabulary stops a sequence, so rows stop at different steps."""
    tok = any_policy.tokenizer
    stops = list(range(0, tok.vocab_size, 3))
    r = rollout_prompts(any_policy, PROMPTS, group_size=6, max_new_tokens=12, generator=gen(1), stop_ids=stops)
    P = r.prompt_len
    assert len(set(r.response_lengths.tolist())) > 1
    for i in range(r.input_ids.shape[0]):
        n = int(r.response_lengths[i])
        resp, rmask = r.input_ids[i, P:], r.response_mask[i, P:]
        assert rmask.tolist() == [1] * n + [0] * (len(rmask) - n)
        assert torch.equal(r.attention_mask[i, P:], rmask)
        assert (resp[n:] == tok.pad_id).all() and (r.logprobs[i, P + n:] == 0).all()
        assert bool(r.truncated[i]) == (int(resp[n - 1]) not in stops)
        if not r.truncated[i]:
            assert all(int(t) not in stops for t in resp[: n - 1])
        assert r.texts[i] == tok.decode(resp[:n].tolist())


def test_stops_right_after_answer_close(gpt_policy):
    """Rig the GPT so `</answer>` is always the argmax: blocks output nothing (zero projections),
    so logits are <rmsnorm(e_last), e_j>; every embedding leans along u, `</answer>`'s is 100 u."""
    m, close = gpt_policy.module, gpt_policy.tokenizer.token_id("</answer>")
    with torch.no_grad():
        for block in m.h:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        u = torch.zeros(m.config.n_embd)
        u[0] = 1.0
        m.wte.weight.mul_(0.01).add_(u)
        m.wte.weight[close] = 100 * u
    for greedy in (True, False):
        r = rollout_prompts(gpt_policy, PROMPTS, group_size=2, max_new_tokens=5, greedy=greedy, generator=gen())
        assert r.input_ids.shape[1] == r.prompt_len + 1  # the loop ended once every row stopped
        assert (r.input_ids[:, r.prompt_len] == close).all()
        assert (r.response_lengths == 1).all() and not r.truncated.any()
        assert r.texts == ["</answer>"] * 6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_recomputed(any_policy, temperature):
    r = rollout_prompts(any_policy, PROMPTS, group_size=3, max_new_tokens=10, temperature=temperature,
                        top_k=20, generator=gen(2))
    with torch.no_grad():
        lp = any_policy.token_logprobs(r.input_ids, r.attention_mask, temperature=temperature)
    diff = ((lp - r.logprobs) * r.response_mask).abs().max()
    assert diff < 1e-4


def test_logprobs_from_response_start_equal_the_full_computation(any_policy):
    """`start=` skips the vocabulary projection over prompt columns; what it returns is unchanged."""
    r = rollout_prompts(any_policy, PROMPTS, group_size=2, max_new_tokens=8, generator=gen(3))
    ids, mask = r.input_ids, r.attention_mask
    with torch.no_grad():
        full = any_policy.token_logprobs(ids, mask)
        part = any_policy.token_logprobs(ids, mask, start=r.prompt_len)
    assert (part[:, : r.prompt_len] == 0).all()
    torch.testing.assert_close(part[:, r.prompt_len:], full[:, r.prompt_len:], atol=1e-6, rtol=0)
    # and with grad: the same gradient on the response log-probs
    any_policy.module.zero_grad()
    (any_policy.token_logprobs(ids, mask, start=r.prompt_len) * r.response_mask).sum().backward()
    g_part = [p.grad.clone() for p in any_policy.module.parameters() if p.grad is not None]
    any_policy.module.zero_grad()
    (any_policy.token_logprobs(ids, mask) * r.response_mask).sum().backward()
    g_full = [p.grad.clone() for p in any_policy.module.parameters() if p.grad is not None]
    for a, b in zip(g_part, g_full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_logprobs_equal_the_plain_computation(any_policy, temperature):
    """`group_size=` runs each group's prompt once (both backends) and the responses on its keys:
    same log-probs and same gradient as one full forward, with rows of different lengths."""
    tok = any_policy.tokenizer
    stops = list(range(0, tok.vocab_size, 4))
    r = rollout_prompts(any_policy, PROMPTS, group_size=4, max_new_tokens=10, temperature=temperature,
                        generator=gen(5), stop_ids=stops)
    ids, mask, P = r.input_ids, r.attention_mask, r.prompt_len
    assert len(set(r.response_lengths.tolist())) > 1  # right padding inside the response block
    assert any_policy._shares_prompt(ids, mask, P, 4)
    assert not any_policy._shares_prompt(ids.roll(1, 0), mask.roll(1, 0), P, 4)  # groups mixed: plain path
    with torch.no_grad():
        plain = any_policy.token_logprobs(ids, mask, temperature, start=P)
        shared = any_policy.token_logprobs(ids, mask, temperature, start=P, group_size=4)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared, r.logprobs, atol=1e-4, rtol=0)
    grads = []
    for g in (1, 4):
        any_policy.module.zero_grad()
        (any_policy.token_logprobs(ids, mask, temperature, start=P, group_size=g) * r.response_mask).sum().backward()
        grads.append([p.grad.clone() for p in any_policy.module.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_shared_prompt_logprobs_with_one_response_column(any_policy):
    r = rollout_prompts(any_policy, PROMPTS, group_size=2, max_new_tokens=1, generator=gen(6))
    with torch.no_grad():
        plain = any_policy.token_logprobs(r.input_ids, r.attention_mask, start=r.prompt_len)
        shared = any_policy.token_logprobs(r.input_ids, r.attention_mask, start=r.prompt_len, group_size=2)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_padding_does_not_change_logprobs(any_policy):
    tok = any_policy.tokenizer
    short, long = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2] + " 1 2 3 4 5")
    assert len(long) > len(short)
    with torch.no_grad():
        alone = any_policy.token_logprobs(torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long))
        ids, mask = left_pad([short, long], tok.pad_id)
        left = any_policy.token_logprobs(ids, mask)[0, -len(short):]
        pad = len(long) - len(short)
        right_ids = torch.tensor([short + [tok.pad_id] * pad, long])
        right_mask = torch.tensor([[1] * len(short) + [0] * pad, [1] * len(long)])
        right = any_policy.token_logprobs(right_ids, right_mask)
    torch.testing.assert_close(left[1:], alone[0, 1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(right[0, : len(short)], alone[0], atol=1e-5, rtol=0)
    assert (right[0, len(short):] == 0).all()


def test_same_seed_same_samples(any_policy):
    a = rollout_prompts(any_policy, PROMPTS, 4, 8, top_p=0.9, generator=gen(7))
    b = rollout_prompts(any_policy, PROMPTS, 4, 8, top_p=0.9, generator=gen(7))
    c = rollout_prompts(any_policy, PROMPTS, 4, 8, top_p=0.9, generator=gen(8))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logprobs, b.logprobs) and a.texts == b.texts
    assert not torch.equal(a.input_ids, c.input_ids)


def test_rollout_tensors_can_enter_autograd(gpt_policy):
    r = rollout_prompts(gpt_policy, PROMPTS[:1], 2, 4, generator=gen())
    gpt_policy.train()
    lp = gpt_policy.token_logprobs(r.input_ids, r.attention_mask)
    ((lp - r.logprobs) * r.response_mask).sum().backward()
    assert gpt_policy.module.wte.weight.grad is not None
    assert gpt_policy.module.training  # rollout restored the mode it found


def test_bad_arguments_are_refused(gpt_policy):
    for kwargs, match in [({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_k": -1}, "top_k"), ({"group_size": 0}, "group_size")]:
        args = {"group_size": 2, **kwargs}
        with pytest.raises(ValueError, match=match):
            rollout_prompts(gpt_policy, PROMPTS, max_new_tokens=4, **args)
    with pytest.raises(ValueError, match="context length"):
        rollout_prompts(gpt_policy, PROMPTS, 1, max_new_tokens=1000)


# ----------------------------------------------------------------------- sampling filters

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.integers(1, 10), top_p=st.floats(0.05, 1.0))
def test_samples_lie_in_top_k_and_nucleus(seed, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 10, generator=g) * 3
    tokens, logp = sample_next(logits, 1.0, top_p, top_k, generator=g)
    ranks = (logits > logits.gather(1, tokens[:, None])).sum(1)  # 0 = most likely
    assert (ranks < top_k).all()
    probs = logits.softmax(-1)
    mass_before = (probs * (logits > logits.gather(1, tokens[:, None]))).sum(1)
    assert (mass_before <= top_p + 1e-6).all()  # the mass ranked above it had not reached top_p
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(1, 300), keep=st.floats(0.002, 1.0))
def test_blocked_cdf_sampling_never_draws_a_zero_weight_token(seed, vocab, keep):
    """The two-level (64-column blocks) inverse CDF: whatever the vocabulary size (padded blocks
    included) and however sparse the weights, every draw is a token of positive weight."""
    from pipeline.rl.rollout import _inverse_cdf_sample

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(64, vocab, generator=g) ** 8  # wide dynamic range
    w = w * (torch.rand(64, vocab, generator=g) < keep)
    w[torch.arange(64), torch.randint(0, vocab, (64,), generator=g)] = 1e-30  # at least one positive, tiny
    tokens = _inverse_cdf_sample(w, g)
    assert tokens.shape == (64,) and (tokens < vocab).all()
    assert (w.gather(1, tokens[:, None]) > 0).all()


def test_blocked_cdf_sampling_with_uniforms_exactly_on_boundaries(monkeypatch):
    """Uniforms that land exactly on a cumulative boundary (0, or the mass of the blocks before)
    must skip the zero-weight columns and blocks there: both searches look for the first CDF value
    strictly above the uniform."""
    from pipeline.rl.rollout import _inverse_cdf_sample

    w = torch.zeros(3, 150)
    w[:2, 1] = w[:2, 5] = 0.25  # block 0 holds half the mass; column 64 (block 1's first) is empty
    w[:2, 65] = 0.5
    w[2, 70] = 1.0  # block 0 entirely empty
    uniforms = torch.tensor([[0.5], [0.0], [0.0]])
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: uniforms.clone())
    assert _inverse_cdf_sample(w, None).tolist() == [65, 1, 70]


def test_blocked_cdf_sampling_frequencies_across_blocks():
    """Across several 64-column blocks (and a padded last one) each token is drawn with its
    probability, and the log-prob returned is log_softmax's."""
    logits = torch.randn(1, 150, generator=gen(5)) * 2
    tokens, logp = sample_next(logits.expand(60_000, 150), generator=gen(6))
    freq = torch.bincount(tokens, minlength=150).double() / tokens.numel()
    torch.testing.assert_close(freq, logits[0].double().softmax(-1), atol=0.006, rtol=0)
    torch.testing.assert_close(logp, logits.log_softmax(-1)[0, tokens], atol=1e-5, rtol=0)


def test_token_logprobs_fused_backward_equals_autograd():
    """The fused log-prob backward gives log_softmax-gather's values and gradients (upstream
    gradients of both signs, logits with a wide range), and passes gradcheck in float64."""
    from pipeline.model.logprobs import token_logprobs

    g = gen(7)
    logits = (torch.randn(3, 5, 40, generator=g) * 6).requires_grad_()
    target = torch.randint(0, 40, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)
    ref = logits.detach().clone().requires_grad_()
    want = ref.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    got = token_logprobs(logits, target)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-6, rtol=0)
    x = torch.randn(4, 9, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: token_logprobs(t, target[0, :4] % 9), (x,))


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 50)
    tokens, _ = sample_next(logits, 1.3, top_k=1, generator=gen())
    assert torch.equal(tokens, logits.argmax(-1))


def test_sampling_frequencies_match_the_distribution():
    """Inverse-CDF sampling draws each token with its probability (including under top-k)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(40_000, 5)
    tokens, _ = sample_next(logits, generator=gen(3))
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    torch.testing.assert_close(freq, logits[0].double().softmax(-1), atol=0.01, rtol=0)
    tokens, _ = sample_next(logits, top_k=2, generator=gen(4))
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    torch.testing.assert_close(freq, torch.tensor([0.7311, 0.2689, 0, 0, 0], dtype=torch.double), atol=0.01, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_hf_shared_prefix_decoder_equals_the_plain_decoder(kind, hf_dirs, monkeypatch):
    """The HF decoder's shared-prefix path (prompt keys read once per group, response keys only,
    no per-step mask) gives the tokens and log-probs of the plain cache-per-row path; the tiny
    Llama has 4 query heads over 2 key/value heads (GQA)."""
    from pipeline.model.hf import HFDecoder
    from pipeline.model.policy import _Autocasting, build_policy
    from tests.conftest import tiny_model_config

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    assert HFDecoder(policy.module, 16).shared
    stops = list(range(0, policy.tokenizer.vocab_size, 5))

    def run(shared: bool, seed: int | None = None, **kw):
        monkeypatch.setattr(policy, "decoder", lambda n: _Autocasting(HFDecoder(policy.module, n, shared), policy))
        return rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=12, stop_ids=stops,
                               generator=None if seed is None else gen(seed), **kw)

    for kw in ({"greedy": True}, {"seed": 9}, {"seed": 10, "temperature": 0.7, "top_k": 20}):
        fast, plain = run(True, **kw), run(False, **kw)
        assert torch.equal(fast.input_ids, plain.input_ids) and fast.texts == plain.texts
        torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    assert len(set(plain.response_lengths.tolist())) > 1  # rows stopped at different steps


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_of_logit_pieces_equal_the_joined_logits_bit_for_bit(temperature):
    """The shared-prompt passes hand `gather_logprobs` their logits in two pieces along the columns
    (the prompt's last position, then the rest) instead of one joined copy: the same log-probs and
    the same gradient to each piece, bit for bit; pieces that do not cover the columns are refused."""
    from pipeline.model.logprobs import gather_logprobs

    g = gen(12)
    N, T, start, V = 6, 9, 4, 30
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[0, 7:] = 0  # a short response: pads
    pieces = [(torch.randn(N, 1, V, generator=g) * 3).requires_grad_(),
              (torch.randn(N, T - 1 - start, V, generator=g) * 3).requires_grad_()]
    refs = [p.detach().clone().requires_grad_() for p in pieces]
    got = gather_logprobs(pieces, ids, mask, temperature, start)
    want = gather_logprobs(torch.cat(refs, dim=1), ids, mask, temperature, start)
    assert got.shape == (N, T) and torch.equal(got, want)
    upstream = torch.randn(N, T, generator=g)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(pieces, refs))
    with pytest.raises(ValueError, match="cover 1 columns, not 5"):
        gather_logprobs(pieces[:1], ids, mask, temperature, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_token_logprobs_equal_one_fp32_pass(dtype):
    """Log-probs and gradients taken over row chunks of the logits (each cast to fp32 only while
    used, temperature inside) equal one fp32 log_softmax over the whole (N, T, V) tensor; the
    gradient comes back in the logits' dtype."""
    from pipeline.model.logprobs import token_logprobs

    g = gen(11)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 50, (3, 7), generator=g)
    upstream = torch.randn(3, 7, generator=g)
    ref = logits.detach().float().requires_grad_()
    want = (ref / 0.7).log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
    got = token_logprobs(logits, target, 0.7, chunk_elements=120)  # 2 rows of 50 per chunk: 11 chunks
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert logits.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.float(), ref.grad, atol=tol, rtol=0)
    x = torch.randn(5, 9, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: token_logprobs(t, target[0, :5] % 9, 1.3, chunk_elements=18), (x,))
