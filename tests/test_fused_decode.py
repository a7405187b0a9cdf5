"""The fused Llama/Qwen2 decode step (pipeline.model.fast.fused_decode) against the module path it
replaces: the same shared-prefix decoder with each step run through the model's own modules."""

import pytest
import torch
from torch import nn

from pipeline.model import fast
from pipeline.model.fast import fused_decode
from pipeline.model.hf import HFDecoder
from pipeline.model.policy import _Autocasting, build_policy
from pipeline.rl.rollout import rollout_prompts
from tests.conftest import tiny_model_config

PROMPTS = ["2+3=", "a longer prompt 17*4=", "x"]


def _rollouts(policy, monkeypatch, **kw):
    out, seed = {}, kw.pop("seed", None)
    for fused in (True, False):
        monkeypatch.setattr(policy, "decoder",
                            lambda n, f=fused: _Autocasting(HFDecoder(policy.module, n, fused=f), policy))
        g = None if seed is None else torch.Generator().manual_seed(seed)
        out[fused] = rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=14, stop_ids=[], generator=g, **kw)
    return out[True], out[False]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_step_equals_the_module_step(kind, hf_dirs, monkeypatch):
    """Greedy: the same tokens exactly; sampled with one seed: the same tokens and log-probs to
    float rounding. The tiny Llama has 4 query heads over 2 key/value heads; Qwen2 has q/k/v biases."""
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    assert fused_decode.supported(policy.module) and HFDecoder(policy.module, 16).use_fused
    dec = HFDecoder(policy.module, 16)
    ids = torch.tensor([[5, 6, 7]])
    dec.prefill(ids, torch.ones_like(ids), torch.arange(3)[None], 2)
    assert dec.fused._whole_cache_bias(12) is None  # fp32: always the slice (the default run's arithmetic)
    for kw in ({"greedy": True}, {"seed": 5}, {"seed": 6, "temperature": 0.7}):
        fast, plain = _rollouts(policy, monkeypatch, **kw)
        assert torch.equal(fast.input_ids, plain.input_ids)
        torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=2e-5, rtol=0)


def test_fused_step_logits_under_bf16_autocast(hf_dirs):
    """Under bf16 autocast each step's logits stay within bf16 rounding of the module path's."""
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"], dtype="bfloat16"))
    ids = torch.randint(5, policy.tokenizer.vocab_size, (2, 6))
    mask, pos = torch.ones_like(ids), torch.arange(6).expand(2, 6)
    decs = [_Autocasting(HFDecoder(policy.module, 16, fused=f), policy) for f in (True, False)]
    with torch.inference_mode():
        first = [d.prefill(ids, mask, pos, 3) for d in decs]
        tokens, p = first[1].argmax(-1), torch.full((6,), 6)
        for _ in range(5):
            fast, plain = (d.step(tokens, p) for d in decs)
            torch.testing.assert_close(fast, plain, atol=0.05 * float(plain.abs().max()), rtol=0)
            tokens, p = plain.argmax(-1), p + 1
    # the bf16 cache on CPU: the slice of the written positions for the first third of the 10
    # response positions, the whole cache with a length bias after (the last two steps above)
    fused = decs[0].inner.fused
    assert fused.cache.k[0].dtype == torch.bfloat16 and fused.cache.k[0].shape[2] == 10
    assert [fused._whole_cache_bias(t) is None for t in (0, 2, 3, 9)] == [True, True, False, False]
    assert torch.equal(fused._whole_cache_bias(3), torch.tensor([0.0] * 4 + [float("-inf")] * 6).bfloat16())


def test_linear_casts_its_weight_once_under_autocast():
    """Under bf16 autocast the step's linear layer gives autocast's own result (weight, bias and
    input cast to bf16) but casts the weight and bias on its first call only, and packs nothing for
    the fp32 GEMM; without autocast it packs on its first call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    lin = fused_decode._Linear(w, b, rows=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.linear(x, w, b)
        with Casts() as first:
            got = lin(x)
        with Casts() as later:
            again = lin(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and torch.equal(again, want)
    assert (6, 4) in first.shapes and (6,) in first.shapes
    assert later.shapes == [(3, 4)]  # only the input
    assert lin.packed is None
    plain = lin(x)
    torch.testing.assert_close(plain, torch.nn.functional.linear(x, w, b), atol=1e-6, rtol=0)
    assert lin.packed is not None or not lin.packable


def test_plain_switch_and_wrapped_layers_take_the_module_path(hf_dirs):
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    with fast.plain():
        assert not HFDecoder(policy.module, 16).use_fused

    class Wrapped(nn.Linear):  # e.g. a LoRA or quantised layer: its forward is not x @ W.T
        pass

    q = policy.module.model.layers[0].self_attn.q_proj
    policy.module.model.layers[0].self_attn.q_proj = Wrapped(q.in_features, q.out_features, bias=False)
    assert not fused_decode.supported(policy.module)
    gpt2 = build_policy(tiny_model_config(backend="hf", init=hf_dirs["gpt2"]))
    assert not fused_decode.supported(gpt2.module) and not HFDecoder(gpt2.module, 16).use_fused


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_fused_gpt_step_equals_the_module_step(positions, tiny_tokenizer, monkeypatch):
    """The from-scratch GPT's fused step against its own forward over the same shared-prefix cache."""
    torch.manual_seed(0)
    policy = build_policy(tiny_model_config(positions=positions), tiny_tokenizer)
    assert fused_decode.gpt_supported(policy.module)
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(fused_decode, "gpt_supported", lambda m, f=fused: f)
        for kw in ({"greedy": True}, {"generator": torch.Generator().manual_seed(4)}):
            out[fused, "greedy" in kw] = rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=14,
                                                         stop_ids=[], **kw)
    for greedy in (True, False):
        fast, plain = out[True, greedy], out[False, greedy]
        assert torch.equal(fast.input_ids, plain.input_ids)
        torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=2e-5, rtol=0)


class _ParamCasts:
    """A dispatch mode counting the casts of each of `module`'s parameters (by storage)."""

    def __init__(self, module: nn.Module):
        from torch.utils._python_dispatch import TorchDispatchMode

        ptrs = {p.data_ptr(): name for name, p in module.named_parameters()}
        counts: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in ptrs:
                    counts[ptrs[args[0].data_ptr()]] = counts.get(ptrs[args[0].data_ptr()], 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode, self.counts = Mode(), counts


@pytest.mark.parametrize("kind", ["gpt", "hf-gpt2", "hf-llama"])
def test_bf16_rollout_casts_each_weight_once(kind, tiny_tokenizer, hf_dirs, monkeypatch):
    """A bf16-autocast rollout casts its weights to bf16 a fixed number of times per rollout, not at
    every decode step (one autocast region for the whole rollout keeps autocast's cast cache;
    inference mode turns that cache off; the fused steps keep their own casts), and samples exactly
    what per-step casts sample: the same tokens and log-probs."""
    from pipeline.rl import rollout as rollout_mod

    torch.manual_seed(0)
    if kind == "gpt":
        policy = build_policy(tiny_model_config(dtype="bfloat16"), tiny_tokenizer)
    else:
        policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind.split("-")[1]], dtype="bfloat16"))

    def run(new_tokens):
        casts = _ParamCasts(policy.module)
        with casts.mode:
            out = rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=new_tokens, stop_ids=[],
                                  generator=torch.Generator().manual_seed(3))
        return out, casts.counts

    got, casts = run(12)
    assert casts and max(casts.values()) <= 2, casts  # the prefill's, and a fused step's own
    assert run(4)[1] == casts  # none per step
    # against rollouts with each step its own autocast region, under no_grad and in inference mode
    monkeypatch.setattr(rollout_mod, "_no_grad_for", lambda policy: torch.no_grad())
    want, per_step = run(12)
    if kind == "hf-gpt2":  # the module path: every weight cast at every step
        assert min(per_step.values()) >= 12
    monkeypatch.setattr(rollout_mod, "_no_grad_for", lambda policy: torch.inference_mode())
    for other in (want, run(12)[0]):
        assert torch.equal(got.input_ids, other.input_ids) and torch.equal(got.logprobs, other.logprobs)


def test_gpt2_module_step_attends_over_the_whole_bf16_cache_past_a_third(hf_dirs, monkeypatch):
    """GPT-2 decodes through its own modules (no fused step). Under bf16 on CPU its steps attend
    over the slice of the written response positions for the first third of the cache, then over
    the whole preallocated cache with the unwritten positions masked (a strided slice costs oneDNN
    a copy per batched matmul); the logits stay within bf16 rounding of the slice form's."""
    from pipeline.model import hf

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["gpt2"], dtype="bfloat16"))
    seen = []
    attend = hf.grouped_prefix_attention

    def spy(q, kp_t, vp, k, v, prefix_bias, **kw):
        seen.append((k.shape[2], kw.get("key_bias") is not None))
        return attend(q, kp_t, vp, k, v, prefix_bias, **kw)

    monkeypatch.setattr(hf, "grouped_prefix_attention", spy)
    ids = torch.randint(5, policy.tokenizer.vocab_size, (2, 6))
    mask, pos = torch.ones_like(ids), torch.arange(6).expand(2, 6)
    whole, sliced = (_Autocasting(HFDecoder(policy.module, 16), policy) for _ in range(2))
    assert whole.inner.shared and not whole.inner.use_fused
    with torch.inference_mode():
        tokens = whole.prefill(ids, mask, pos, 3).argmax(-1)
        sliced.prefill(ids, mask, pos, 3)
        p = torch.full((6,), 6)
        for t in range(10):
            seen.clear()
            a = whole.step(tokens, p)
            layers = len(seen)
            assert seen == [(10, True)] * layers if 3 * (t + 1) > 10 else seen == [(t + 1, False)] * layers
            with monkeypatch.context() as m:
                m.setattr(hf, "whole_cache_key_bias", lambda k, t: None)
                b = sliced.step(tokens, p)
            torch.testing.assert_close(a, b, atol=0.02 * float(b.abs().max()), rtol=0)
            tokens, p = b.argmax(-1), p + 1
    fp32 = HFDecoder(build_policy(tiny_model_config(backend="hf", init=hf_dirs["gpt2"])).module, 16)
    fp32.prefill(ids, mask, pos, 3)
    assert hf.whole_cache_key_bias(fp32.cache.k[0], 9) is None  # fp32: always the slice
