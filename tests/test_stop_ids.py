"""An instruct model's end-of-turn tokens end a rollout: the eos ids of a HF model's
`generation_config` (`<|im_end|>`, `<|eot_id|>`: an int or a list) stop a row like the tokenizer's
eos, count as its last response token, are stripped from its text, survive a checkpoint, and every
decode path (fused step, module step, shared prefix or not, the plain path) stops at the same place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model import fast
from pipeline.model.hf import HFDecoder
from pipeline.model.policy import Policy, _Autocasting, build_policy
from pipeline.rl.rollout import rollout_prompts
from pipeline.train.checkpoint import load_policy, save_policy
from tests.conftest import tiny_model_config

PROMPTS = ["2+3=", "a longer prompt 17*4=", "x"]
END = 7  # the end-of-turn id of the tiny "instruct" Llama (its tokenizer's eos is another id)


def instruct_policy(init: str, end: int | list[int], bias: float = 0.0) -> Policy:
    """The tiny Llama with `end` as its generation_config's eos ids (beside the tokenizer's eos), its
    head biased by `bias` toward `END`."""
    policy = build_policy(tiny_model_config(backend="hf", init=init))
    module = policy.module
    eos = policy.tokenizer.eos_id
    module.generation_config.eos_token_id = [eos, *end] if isinstance(end, list) else end
    if bias:
        head = nn.Linear(module.lm_head.in_features, module.lm_head.out_features, bias=True)
        head.weight = module.lm_head.weight
        nn.init.zeros_(head.bias)
        with torch.no_grad():
            head.bias[END] = bias
        module.lm_head = head
    return Policy(module, policy.tokenizer, policy.model_cfg)


def responses(ro):
    """Each row's response tokens (its `response_lengths` of them) as lists."""
    return [ro.input_ids[i, ro.prompt_len:ro.prompt_len + int(n)].tolist() for i, n in enumerate(ro.response_lengths)]


@pytest.mark.parametrize("end", [END, [END]])
def test_a_row_stops_at_the_generation_configs_eos_and_it_is_the_last_response_token(end, hf_dirs):
    policy = instruct_policy(hf_dirs["llama"], end, bias=5.0)
    tok = policy.tokenizer
    assert END != tok.eos_id and {tok.eos_id, END} <= set(policy.stop_ids)
    ro = rollout_prompts(policy, PROMPTS, group_size=4, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    resp, Tp = responses(ro), ro.prompt_len
    ended = [i for i, r in enumerate(resp) if r[-1] == END]
    assert ended and any(len(resp[i]) > 1 for i in ended)  # rows stop on it, some after other tokens
    for i, r in enumerate(resp):
        n = len(r)
        assert END not in r[:-1] and tok.eos_id not in r[:-1]  # nothing after a stop token
        assert bool(ro.truncated[i]) == (r[-1] not in (END, tok.eos_id))
        assert ro.response_mask[i, Tp:].tolist() == [1] * n + [0] * (ro.input_ids.shape[1] - Tp - n)
        assert (ro.logprobs[i, Tp:Tp + n] < 0).all() and (ro.logprobs[i, Tp + n:] == 0).all()
        assert (ro.input_ids[i, Tp + n:] == tok.pad_id).all()
        body = r[:-1] if i in ended else r
        assert ro.texts[i] == tok.decode(body) == tok.decode(r)  # the stop token is stripped like eos
    assert tok.decode([5, END, 6]) == tok.decode([5, 6])


def test_a_checkpoint_keeps_the_generation_config_and_still_stops_on_it(hf_dirs, tmp_path):
    policy = instruct_policy(hf_dirs["llama"], [END])
    save_policy(tmp_path / "ckpt", policy)
    assert (tmp_path / "ckpt" / "generation_config.json").is_file()
    loaded = load_policy(tmp_path / "ckpt", device="cpu")
    assert END in loaded.stop_ids and loaded.tokenizer.decode([5, END]) == loaded.tokenizer.decode([5])
    pytest.importorskip("peft")
    from pipeline.model.lora import add_lora

    cfg = tiny_model_config(backend="hf", init=hf_dirs["llama"], lora_rank=2, lora_targets=["q_proj"])
    add_lora(policy, cfg)  # the merged export of a LoRA policy keeps it too
    save_policy(tmp_path / "lora", policy)
    assert END in load_policy(tmp_path / "lora", device="cpu").stop_ids


def test_the_gpt_backend_stops_on_its_tokenizers_eos_only(gpt_policy):
    tok = gpt_policy.tokenizer
    assert gpt_policy.stop_ids == [tok.eos_id, tok.token_id("</answer>")]


def _decoder(policy, **kw):
    return lambda n: _Autocasting(HFDecoder(policy.module, n, **kw), policy)


def test_every_decode_path_stops_at_the_same_token(hf_dirs, monkeypatch):
    """`end` is a token the tiny Llama emits greedily after other tokens: with it as an end-of-turn id
    each row ends at its first stop token (or runs to the limit), and the fused step, the module step,
    the non-shared cache and the plain path (fast paths off) give the same rollout; sampled with one
    seed, the fast decoders agree too."""
    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    free = rollout_prompts(policy, PROMPTS, group_size=1, max_new_tokens=10, greedy=True, stop_ids=[])
    rows = free.input_ids[:, free.prompt_len:].tolist()
    stops = set(policy.stop_ids)
    end = next(t for row in rows for k, t in enumerate(row) if k > 0 and t not in stops and not stops & set(row[:k]))
    policy.module.generation_config.eos_token_id = [policy.tokenizer.eos_id, end]
    policy = Policy(policy.module, policy.tokenizer, policy.model_cfg)
    stops.add(end)
    assert set(policy.stop_ids) == stops
    paths = {"fused": {}, "module": {"fused": False}, "not shared": {"shared_prefix": False}}
    for greedy in (True, False):
        out = {}
        for name, kw in paths.items():
            monkeypatch.setattr(policy, "decoder", _decoder(policy, **kw))
            g = torch.Generator().manual_seed(3)
            out[name] = rollout_prompts(policy, PROMPTS, group_size=2, max_new_tokens=10, greedy=greedy, generator=g)
        monkeypatch.undo()
        if greedy:
            with fast.plain():
                out["plain"] = ro = rollout_prompts(policy, PROMPTS, group_size=2, max_new_tokens=10, greedy=True)
            for row, n, cut in zip(rows, ro.response_lengths[::2].tolist(), ro.truncated[::2].tolist()):
                at = next((k for k, t in enumerate(row) if t in stops), None)
                assert (n, cut) == ((10, True) if at is None else (at + 1, False))
            assert any(len(r) > 1 and r[-1] == end for r in responses(ro))
        ref = out["fused"]
        for name, ro in out.items():
            assert torch.equal(ro.input_ids, ref.input_ids), name
            assert torch.equal(ro.response_mask, ref.response_mask) and torch.equal(ro.truncated, ref.truncated), name
            assert ro.texts == ref.texts, name
            torch.testing.assert_close(ro.logprobs, ref.logprobs, atol=2e-5, rtol=0)
