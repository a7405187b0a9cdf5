"""Decoding drops the rows that finished: greedy rows that stopped (every backend and HF cache
kind) and sampled groups whose rows all stopped, with the same tokens and log-probs, bit for bit, as
decoding every row; the MKL row-count assumption that rests on; whole groups only where rows share a
prompt's keys; the plain sampler keeping every row."""

from __future__ import annotations

import pytest
import torch

from pipeline.rl.rollout import left_pad, rollout_prompts
from tests.conftest import ROLLOUT_PROMPTS as PROMPTS
from tests.conftest import seeded as gen

class _SelectSpy:
    """A policy's decoder that records how many rows each `select` kept."""

    def __init__(self, inner, kept: list[int]) -> None:
        self.inner, self.kept = inner, kept

    def prefill(self, *args):
        return self.inner.prefill(*args)

    def step(self, tokens, positions):
        return self.inner.step(tokens, positions)

    def select(self, rows):
        ok = self.inner.select(rows)
        if ok:
            self.kept.append(len(rows))
        return ok


def _stops_for_varied_lengths(policy, prompts: list[str], n: int) -> list[int]:
    """Stop tokens that end these prompts' greedy completions at three or more different steps with
    at least one row running to the end: greedy tokens do not depend on the stop set, so each
    candidate set's lengths are read off one run without stops."""
    import itertools

    r = rollout_prompts(policy, prompts, 1, n, greedy=True, stop_ids=[])
    resp = r.input_ids[:, r.prompt_len:].tolist()
    for size in (1, 2, 3):
        for stops in itertools.combinations(sorted({t for row in resp for t in row}), size):
            lengths = [next((i + 1 for i, t in enumerate(row) if t in stops), n) for row in resp]
            ends = {length for length, row in zip(lengths, resp) if row[length - 1] in stops}
            if len(ends) >= 3 and any(all(t not in stops for t in row) for row in resp):
                return list(stops)
    raise AssertionError(f"no stop set gives varied lengths: {resp}")


def _greedy_with_and_without_compaction(policy, monkeypatch, make_decoder):
    import pipeline.rl.rollout as ro

    prompts = PROMPTS + [p + " x" for p in PROMPTS] + [f"Question: {a} + {b}?" for a, b in ((5, 5), (12, 7), (3, 40))]
    with torch.no_grad():  # a random init's greedy rows repeat one token; scaled up, each row wanders
        for param in policy.module.parameters():
            if param.dim() >= 2:
                param.mul_(10.0)
    stops = _stops_for_varied_lengths(policy, prompts, 16)
    kept: list[int] = []
    monkeypatch.setattr(policy, "decoder", lambda n: _SelectSpy(make_decoder(n), kept))
    monkeypatch.setattr(ro, "COMPACT_EVERY", 2)  # every other step, ...
    monkeypatch.setattr(ro, "COMPACT_FRACTION", 10**9)  # ... as soon as any row has stopped, ...
    monkeypatch.setattr(ro, "COMPACT_MIN_ROWS", 1)  # ... down to one row (greedy tokens; log-probs to 1e-5)
    compacted = rollout_prompts(policy, prompts, 1, 16, greedy=True, stop_ids=stops)
    monkeypatch.setattr(ro, "COMPACT_EVERY", 10**9)  # never: every row decodes to the end
    every_row = rollout_prompts(policy, prompts, 1, 16, greedy=True, stop_ids=stops)
    return compacted, every_row, kept, len(prompts)


def _assert_same_rollout(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and a.texts == b.texts
    for name in ("attention_mask", "response_mask", "response_lengths", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_greedy_decoding_drops_the_rows_that_stopped(any_policy, monkeypatch):
    """Greedy decoding of one row per prompt (evaluation, held-out checks) drops the rows that have
    stopped from the decoder's cache; the completions, masks, lengths, truncation flags and
    log-probs are those of decoding every row to the end."""
    base = any_policy.decoder
    compacted, every_row, kept, n = _greedy_with_and_without_compaction(any_policy, monkeypatch, base)
    assert len(kept) >= 2 and n > kept[0] and kept == sorted(kept, reverse=True)  # rows left the batch in steps
    assert len(set(every_row.response_lengths.tolist())) > 2 and not every_row.truncated.all()
    _assert_same_rollout(compacted, every_row)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_compaction_on_the_hf_cache_per_row(kind, cache, hf_dirs, monkeypatch):
    """The same on a transformers model's own cache (the HF decoder without a shared prefix): its
    StaticCache, and the DynamicCache of a model that cannot take one."""
    from pipeline.model.hf import HFDecoder
    from pipeline.model.policy import _Autocasting, build_policy
    from tests.conftest import tiny_model_config

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))
    if cache == "dynamic":
        monkeypatch.setattr(policy.module, "_can_compile_fullgraph", False, raising=False)

    def make(n):
        dec = HFDecoder(policy.module, n, shared_prefix=False)
        assert dec.static == (cache == "static")
        return _Autocasting(dec, policy)

    compacted, every_row, kept, n = _greedy_with_and_without_compaction(policy, monkeypatch, make)
    assert kept and kept[0] < n
    _assert_same_rollout(compacted, every_row)


def test_a_cache_layer_with_more_per_row_state_keeps_every_row(hf_dirs, monkeypatch):
    """A cache layer of a type whose per-row state is more than its keys and values (the
    linear-attention and indexed layers of hybrid models) is never cut: the decoder declines
    `select` and every row decodes to the end, with the same completions."""
    from transformers.cache_utils import StaticLayer

    from pipeline.model.hf import HFDecoder
    from pipeline.model.policy import _Autocasting, build_policy
    from tests.conftest import tiny_model_config

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    other = type("OtherLayer", (StaticLayer,), {})

    def make(n):
        dec = HFDecoder(policy.module, n, shared_prefix=False)
        dec.cache.layers[0].__class__ = other
        return _Autocasting(dec, policy)

    compacted, every_row, kept, _ = _greedy_with_and_without_compaction(policy, monkeypatch, make)
    assert kept == []
    _assert_same_rollout(compacted, every_row)


def _stops_for_group_ends(policy, prompts: list[str], G: int, n: int, seed: int) -> list[int]:
    """Stop tokens under which the groups of a seeded sampled rollout finish (every row stopped)
    at two or more different steps before `n`, with some row still running at the end. A row's
    tokens up to its stop do not depend on the stop set (its own uniforms, its own history), so
    each candidate set's lengths are read off one run without stops."""
    import itertools

    r = rollout_prompts(policy, prompts, G, n, generator=gen(seed), stop_ids=[])
    resp = r.input_ids[:, r.prompt_len:].tolist()
    for size in (1, 2, 3):
        for stops in itertools.combinations(sorted({t for row in resp for t in row}), size):
            lengths = [next((i + 1 for i, t in enumerate(row) if t in stops), None) for row in resp]
            ends = [None if None in lengths[g:g + G] else max(lengths[g:g + G]) for g in range(0, len(resp), G)]
            early = {e for e in ends if e is not None and e < n - 2}
            if len(early) >= 2 and None in ends:
                return list(stops)
    raise AssertionError(f"no stop set gives varied group ends: {resp}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.slow
def test_sampled_rollouts_drop_finished_groups_with_the_same_bits(any_policy, G, threads, monkeypatch):
    """Sampled rollouts drop the rows (G = 1) or whole groups (G > 1: the rows of a prompt share its
    keys) that have finished; each remaining row keeps its own uniform of the whole batch, so on CPU
    fp32 the tokens and the recorded log-probs are bit for bit those of decoding every row to the
    end (the warmup trains on those log-probs as its old policy). One exception, at two threads: the
    GPT's per-row cache (one row per prompt) attends through torch's SDPA, whose CPU kernel splits
    its work by the batch size, so there the log-probs agree to rounding."""
    import pipeline.rl.rollout as ro

    policy = any_policy
    n_prompts = 36 // G  # 36 rows: room for several cuts above COMPACT_MIN_ROWS
    prompts = [f"Question: {a} + {b}?" for a, b in zip(range(3, 3 + n_prompts), range(40, 40 - n_prompts, -1))]
    with torch.no_grad():  # a random init samples near-uniformly; scaled up, rows are peaked but varied
        for param in policy.module.parameters():
            if param.dim() >= 2:
                param.mul_(4.0)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stops = _stops_for_group_ends(policy, prompts, G, 16, seed=1)
        kept: list[int] = []
        base = policy.decoder
        monkeypatch.setattr(policy, "decoder", lambda n: _SelectSpy(base(n), kept))
        monkeypatch.setattr(ro, "COMPACT_EVERY", 1)  # every step, ...
        monkeypatch.setattr(ro, "COMPACT_FRACTION", 10**9)  # ... as soon as one row or group has finished
        compacted = rollout_prompts(policy, prompts, G, 16, generator=gen(1), stop_ids=stops)
        cuts = list(kept)
        monkeypatch.setattr(ro, "COMPACT_EVERY", 10**9)  # never
        every_row = rollout_prompts(policy, prompts, G, 16, generator=gen(1), stop_ids=stops)
    finally:
        torch.set_num_threads(saved)
    assert len(cuts) >= 2 and cuts == sorted(cuts, reverse=True)
    assert all(k % G == 0 and k >= ro.COMPACT_MIN_ROWS for k in cuts)
    assert not every_row.truncated.all() and every_row.truncated.any()
    _assert_same_rollout(compacted, every_row)
    sdpa_per_row = G == 1 and type(policy.module).__name__ == "GPT"
    if threads == 1 or not sdpa_per_row:
        assert torch.equal(compacted.logprobs, every_row.logprobs)  # the same bits, not only close


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_matmul_does_not_depend_on_the_row_count_from_the_cut_minimum(threads):
    """What the same bits rest on: from COMPACT_MIN_ROWS rows up, a row's product with a weight is
    the same bits whatever the other rows (MKL packed for that count, or plain; oneDNN's one packed
    copy at any count), on this CPU's kernels."""
    from pipeline.model.fast import packed
    from pipeline.rl.rollout import COMPACT_MIN_ROWS

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = gen(3)
        for out_f, in_f in ((384, 128), (128, 128), (512, 128), (128, 512), (2048, 128)):
            w, x = torch.randn(out_f, in_f, generator=g) * 0.05, torch.randn(128, in_f, generator=g)
            full = torch.nn.functional.linear(x, w)
            onednn = packed.OneDNNWeight(w, None, 128) if packed.onednn_available() else None
            for m in range(COMPACT_MIN_ROWS, 129, 3):
                assert torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]), (out_f, in_f, m)
                if packed.mkl_available():
                    got = torch.ops.mkl._mkl_linear(x[:m], torch.ops.mkl._mkl_reorder_linear_weight(w, m), w, None, m)
                    assert torch.equal(got, full[:m]), (out_f, in_f, m)
                if packed.onednn_available():  # the rollout's GEMM: one copy packed for 128 rows, any count
                    assert torch.equal(onednn(x[:m]), onednn(x)[:m]), (out_f, in_f, m)
    finally:
        torch.set_num_threads(saved)


def test_a_cut_keeps_whole_groups_only(gpt_policy):
    """A decoder whose G rows share a prompt's keys refuses a cut through a group, and keeps the
    prompts of the groups it keeps."""
    from pipeline.model.attention import whole_groups

    assert whole_groups(torch.tensor([3, 4, 5, 9, 10, 11]), 3).tolist() == [1, 3]
    for rows in ([3, 4, 9, 10, 11, 12], [0, 1], [], [4, 5, 6]):
        assert whole_groups(torch.tensor(rows, dtype=torch.long), 3) is None
    dec = gpt_policy.decoder(40)
    ids, mask = left_pad([gpt_policy.tokenizer.encode(p) for p in PROMPTS], gpt_policy.tokenizer.pad_id)
    with torch.inference_mode():
        dec.prefill(ids, mask, mask.cumsum(-1).clamp(min=1) - 1, 2)  # 3 prompts x 2 rows
        c = dec.inner.cache
        assert c.prefix is not None and dec.inner.fused is not None
        assert not dec.select(torch.tensor([0, 1, 2, 4, 5]))
        assert c.k.shape[1] == 6
        assert dec.select(torch.tensor([0, 1, 4, 5]))
        assert c.k.shape[1] == 4 and c.prefix.k.shape[1] == 2
        assert c.prefix_k_t.shape[1] == 2 and c.prefix_bias.shape[0] == 2
        assert dec.inner.fused.prefix[0][0].shape[0] == 2 and dec.inner.fused.key_mask.shape[0] == 4
        # the groups kept decode as they would have in the whole batch
        whole = gpt_policy.decoder(40)
        whole.prefill(ids, mask, mask.cumsum(-1).clamp(min=1) - 1, 2)
        tokens, pos = torch.tensor([5, 6, 9, 9, 7, 8]), torch.tensor([20, 20, 9, 9, 21, 21])
        torch.testing.assert_close(dec.step(tokens[[0, 1, 4, 5]], pos[[0, 1, 4, 5]]), whole.step(tokens, pos)[[0, 1, 4, 5]],
                                   atol=1e-5, rtol=0)


def test_the_plain_sampler_keeps_every_row(gpt_policy, monkeypatch):
    """Without the fast paths (torch.multinomial: draws that depend on the rows present) no row
    leaves a sampled rollout."""
    import pipeline.rl.rollout as ro
    from pipeline.model import fast

    kept: list[int] = []
    base = gpt_policy.decoder
    monkeypatch.setattr(gpt_policy, "decoder", lambda n: _SelectSpy(base(n), kept))
    monkeypatch.setattr(ro, "COMPACT_EVERY", 1)
    stops = list(range(0, gpt_policy.tokenizer.vocab_size, 3))
    with fast.plain():
        rollout_prompts(gpt_policy, PROMPTS, 2, 12, generator=gen(0), stop_ids=stops)
        with pytest.raises(ValueError, match="fast-path sampler"):
            ro._draw(torch.ones(2, 5), gen(0), torch.tensor([0, 1]), 3)
    assert kept == []


def test_subset_draws_take_their_rows_uniforms():
    """Row i of a subset gets uniform rows[i] of the whole batch: the same draw as in the full batch."""
    from pipeline.rl.rollout import _inverse_cdf_sample

    w = torch.rand(7, 300, generator=gen(2)) ** 4
    full = _inverse_cdf_sample(w, gen(5))
    rows = torch.tensor([1, 4, 6])
    assert torch.equal(_inverse_cdf_sample(w[rows], gen(5), rows, 7), full[rows])
