"""The from-scratch GPT and the Policy interface: cached == uncached, padding invariance, sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.core.config import ModelConfig
from pipeline.model.attention import grouped_prefix_attention, positions_from_mask
from pipeline.model.gpt import GPT, GPTConfig, GPTDecoder, count_params
from pipeline.model.policy import build_policy, resolve_autocast, resolve_device
from tests.conftest import tiny_model_config


def tiny_gpt(positions: str = "rope", **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=64, positions=positions, **kw)).eval()


def test_seed_size_is_about_406m_params():
    seed = GPTConfig(vocab_size=2048, n_layer=24, n_head=16, n_embd=1024, block_size=1024, positions="learned")
    assert abs(count_params(seed) - 406e6) / 406e6 < 0.01
    assert abs(count_params(dataclasses.replace(seed, positions="rope")) - 406e6) / 406e6 < 0.01


def test_default_size_fits_two_cpu_cores():
    # 4 x 128 (~1.3M): its SFT takes about as long as 3 x 96's on 2 cores and its GRPO warmup gains
    # 2-3x as much held-out accuracy (docs/results/cpu-defaults.md); 4 x 256 no longer fits minutes
    mc = ModelConfig()  # the params.yaml defaults
    n = count_params(GPTConfig.from_model_config(mc, vocab_size=2048))
    assert 0.3e6 < n < 5e6


def test_head_is_tied_to_embedding():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_decoding_equals_uncached(positions):
    model = tiny_gpt(positions)
    idx = torch.randint(0, 64, (3, 20))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        cache = model.new_cache(3, 20)
        parts = [model(idx[:, :8], position_ids=torch.arange(8).expand(3, 8), cache=cache)]
        for t in range(8, 20):
            parts.append(model(idx[:, t:t + 1], position_ids=torch.full((3, 1), t), cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_greedy_tokens_equal_uncached(positions):
    model = tiny_gpt(positions)
    prompt = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = prompt
        for _ in range(10):  # plain reference loop: recompute the whole prefix each step
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
        cache = model.new_cache(2, 15)
        seq = prompt
        logits = model(prompt, position_ids=torch.arange(5).expand(2, 5), cache=cache)[:, -1]
        for t in range(5, 15):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            if t < 14:
                logits = model(nxt, position_ids=torch.full((2, 1), t), cache=cache)[:, -1]
    assert torch.equal(seq, ref)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_left_and_right_padding_do_not_change_logits(positions):
    model = tiny_gpt(positions)
    seq = torch.randint(2, 64, (1, 7))
    with torch.no_grad():
        alone = model(seq)[0]  # (T, V)
        left = model(torch.cat([torch.zeros(1, 4, dtype=torch.long), seq], 1),
                     torch.tensor([[0] * 4 + [1] * 7]))[0, 4:]
        right = model(torch.cat([seq, torch.zeros(1, 4, dtype=torch.long)], 1),
                      torch.tensor([[1] * 7 + [0] * 4]))[0, :7]
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]]


def test_too_long_sequence_is_refused():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_dropout_only_in_train_mode():
    model = tiny_gpt(dropout=0.5)
    idx = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(idx), model(idx))
        model.train()
        assert not torch.equal(model(idx), model(idx))


def test_policy_decoder_matches_full_forward(any_policy):
    """Both backends: prefill + cached steps give the logits of one full padded forward."""
    policy = any_policy.eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # row 0 left-padded
    ids[0, :2] = policy.tokenizer.pad_id
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    nxt = torch.tensor([[20, 21, 22], [23, 24, 25]])
    with torch.no_grad():
        full = policy.logits(torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1))
        dec = policy.decoder(9)
        pos = positions_from_mask(mask)
        steps = [dec.prefill(ids, mask, pos, 1)]
        for t in range(2):
            steps.append(dec.step(nxt[:, t], pos[:, -1] + 1 + t))
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:8], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("positions", "dtype"), [("rope", None), ("learned", None), ("rope", torch.bfloat16)])
def test_shared_prefix_decoding_equals_full_forward(positions, dtype):
    """G rows reading one copy of their (left-padded) prompt's keys, each with its own continuation;
    also under bf16 autocast (the GPU path's dtype), to bf16 rounding."""
    model, G = tiny_gpt(positions), 3
    ids = torch.randint(2, 64, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    nxt = torch.randint(2, 64, (2 * G, 4))  # a different continuation per row
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        full = model(torch.cat([ids.repeat_interleave(G, 0), nxt], 1),
                     torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(nxt)], 1))  # (N, 10, V)
        dec = GPTDecoder(model, 10, dtype=dtype)
        pos = positions_from_mask(mask)
        steps = [dec.prefill(ids, mask, pos, G)]
        assert dec.cache.prefix is not None and dec.cache.k.shape[1] == 2 * G
        next_pos = pos[:, -1].repeat_interleave(G) + 1
        for t in range(3):
            steps.append(dec.step(nxt[:, t], next_pos + t))
    atol = 1e-5 if dtype is None else 2e-2
    torch.testing.assert_close(torch.stack(steps, 1).float(), full[:, 5:9].float(), atol=atol, rtol=0)


def test_grouped_prefix_attention_equals_per_row_attention():
    """The shared decode attention of both backends against a plain loop: row i attends to its
    prompt's keys (masked pads), then its own keys (masked), with GQA (2 query heads per key head)."""
    torch.manual_seed(0)
    B, G, Hkv, r, Tp, t, D = 3, 4, 2, 2, 5, 3, 8
    N = B * G
    q = torch.randn(N, Hkv * r, 1, D)
    kp, vp = torch.randn(B, Hkv, Tp, D), torch.randn(B, Hkv, Tp, D)
    k, v = torch.randn(N, Hkv, t, D), torch.randn(N, Hkv, t, D)
    prompt_mask = torch.ones(B, Tp, dtype=torch.bool)
    prompt_mask[0, :2] = False  # a left-padded prompt
    key_mask = torch.rand(N, t) > 0.3
    key_mask[:, -1] = True  # every row sees at least its newest key
    bias = torch.zeros(B, 1, 1, Tp).masked_fill(~prompt_mask[:, None, None], float("-inf"))
    for km in (key_mask, None):
        got = grouped_prefix_attention(q, kp.transpose(-1, -2), vp, k, v, bias, km)
        want = torch.empty_like(got)
        for i in range(N):
            for h in range(Hkv * r):
                keys = torch.cat([kp[i // G, h // r], k[i, h // r]])  # (Tp + t, D)
                vals = torch.cat([vp[i // G, h // r], v[i, h // r]])
                allowed = torch.cat([prompt_mask[i // G], km[i] if km is not None else torch.ones(t, dtype=torch.bool)])
                s = (keys @ q[i, h, 0]) / D ** 0.5
                want[i, h, 0] = s.masked_fill(~allowed, float("-inf")).softmax(0) @ vals
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_grouped_prefix_attention_over_a_whole_cache_with_a_length_bias():
    """`key_bias`: the row keys are a whole preallocated cache of M positions, those past the
    written t masked by a shared additive bias. The same attention as over the slice of the t
    written positions, whatever the unwritten ones hold (here large values, not zeros)."""
    torch.manual_seed(1)
    B, G, Hkv, r, Tp, t, M, D = 2, 3, 2, 2, 4, 3, 7, 8
    N = B * G
    q = torch.randn(N, Hkv * r, 1, D)
    kp, vp = torch.randn(B, Hkv, Tp, D), torch.randn(B, Hkv, Tp, D)
    k, v = torch.randn(N, Hkv, M, D) * 50, torch.randn(N, Hkv, M, D) * 50
    bias = torch.zeros(B, Hkv, 1, Tp)
    bias[1, :, :, 0] = float("-inf")
    key_bias = torch.zeros(M).masked_fill(torch.arange(M) >= t, float("-inf"))
    whole = grouped_prefix_attention(q, kp.transpose(-1, -2).contiguous(), vp, k, v, bias, key_bias=key_bias)
    sliced = grouped_prefix_attention(q, kp.transpose(-1, -2).contiguous(), vp, k[:, :, :t], v[:, :, :t], bias)
    torch.testing.assert_close(whole, sliced, atol=1e-5, rtol=0)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:], v2[:, :, t:] = -k2[:, :, t:], 3 * v2[:, :, t:]  # the masked positions never count
    again = grouped_prefix_attention(q, kp.transpose(-1, -2).contiguous(), vp, k2, v2, bias, key_bias=key_bias)
    assert torch.equal(again, whole)


def test_policy_interface(gpt_policy):
    p = gpt_policy
    assert p.device == torch.device("cpu") and p.autocast_dtype is None
    assert p.num_params() == sum(t.numel() for t in p.module.parameters())
    ref = p.frozen_copy()
    assert all(not t.requires_grad for t in ref.module.parameters()) and not ref.module.training
    with torch.no_grad():
        next(p.module.parameters()).add_(1.0)
    assert not torch.equal(next(p.module.parameters()), next(ref.module.parameters()))
    assert p.train().module.training and not p.eval().module.training
    assert set(p.state_dict()) == set(p.module.state_dict())
    assert p.tokenizer.token_id("</answer>") in p.stop_ids and p.tokenizer.eos_id in p.stop_ids


def test_hf_policy_stop_ids_include_answer_close(hf_dirs):
    p = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    assert p.tokenizer.token_id("</answer>") in p.stop_ids
    assert p.tokenizer.token_id("no-such-token") is None


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_autocast("auto", torch.device("cpu")) is None
    assert resolve_autocast("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_autocast("float32", torch.device("cuda")) is None


def test_bad_backend_and_missing_init_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="model.init"):
        build_policy(ModelConfig(backend="hf", init=""))
    with pytest.raises(ValueError, match="'gpt' or 'hf'"):  # the schema refuses it before any policy is built
        build_policy(dataclasses.replace(ModelConfig(), backend="jax"), tiny_tokenizer)


def test_gpt_config_takes_its_shape_from_the_model_config():
    """GPTConfig repeats none of ModelConfig's shape fields by hand: same names, types and defaults."""
    import dataclasses
    import typing

    from pipeline.core.config import ModelConfig
    from pipeline.model.gpt import SHAPE_FIELDS

    gpt, model = GPTConfig(), ModelConfig()
    gpt_types, model_types = typing.get_type_hints(GPTConfig), typing.get_type_hints(ModelConfig)
    for name in SHAPE_FIELDS:
        assert getattr(gpt, name) == getattr(model, name), name
        assert gpt_types[name] == model_types[name] or typing.get_origin(model_types[name]) is typing.Literal, name
    mc = dataclasses.replace(model, n_layer=3, n_embd=48, n_head=3, positions="learned", block_size=96)
    built = GPTConfig.from_model_config(mc, vocab_size=300)
    assert (built.n_layer, built.n_embd, built.n_head, built.positions, built.block_size, built.vocab_size) == (
        3, 48, 3, "learned", 96, 300)


def test_rope_with_the_signed_sin_is_rotate_half_bit_for_bit():
    """`apply_rope` multiplies [x2, x1] by the signed sin table instead of negating x2: the same
    values and gradients as HF Llama's ``x * cos + rotate_half(x) * sin``, bit for bit."""
    from pipeline.model.gpt import _rope_tables, apply_rope

    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=40)
    cos, sin_signed = _rope_tables(cfg)
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    emb = torch.outer(torch.arange(40, dtype=torch.float32), inv_freq).repeat(1, 2)  # (S, D)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin_signed, torch.cat([-emb.sin()[:, :half], emb.sin()[:, half:]], -1))
    torch.manual_seed(1)
    x = (torch.randn(3, 2, 40, cfg.head_dim) * 5).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    pos = torch.randint(0, 40, (3, 40))
    got = apply_rope(x, cos[pos][:, None], sin_signed[pos][:, None])
    x1, x2 = ref.chunk(2, dim=-1)
    want = ref * emb.cos()[pos][:, None] + torch.cat([-x2, x1], dim=-1) * emb.sin()[pos][:, None]
    assert torch.equal(got, want)
    upstream = torch.randn_like(got)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_prompt_keys_per_row_equal_a_repeated_copy_bit_for_bit():
    """The log-prob passes' rows read their group's prompt keys through an expanded view: the same
    keys, and the same gradient to the prompt (summed over the group), as a repeat_interleave copy."""
    from pipeline.model.gpt import PromptKV

    torch.manual_seed(2)
    B, G, H, Tp, T, D = 3, 4, 2, 5, 6, 8
    kv = PromptKV(torch.ones(B, Tp), G)
    prompt = torch.randn(B, H, Tp, D, requires_grad=True)
    own = torch.randn(B * G, H, T, D, requires_grad=True)
    got = kv._per_row(prompt, own)
    want = torch.cat([prompt.repeat_interleave(G, dim=0), own], dim=2)
    assert got.shape == (B * G, H, Tp + T, D) and torch.equal(got, want)
    upstream = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * upstream).sum(), (prompt, own))
    want_grads = torch.autograd.grad((want * upstream).sum(), (prompt, own))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
