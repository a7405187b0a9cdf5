"""Under torch.compile the policy's forward sees bucketed widths (multiples of COMPILE_BUCKET, and
`logits_from` rounded down to one), so rollouts of any length reuse a few compiled shapes; the
log-probs are those of the plain forward. The runner here records shapes instead of compiling
(compiling on a CPU takes minutes; bench/device_check.sh compiles on a GPU and reports recompiles)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.model.policy import COMPILE_BUCKET
from tests.conftest import tiny_model_config


@pytest.mark.parametrize("backend", ["gpt", "hf"])
def test_compiled_forward_sees_bucketed_widths_and_gives_the_same_logprobs(backend, tiny_tokenizer, hf_dirs):
    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    cfg = tiny_model_config() if backend == "gpt" else tiny_model_config(backend="hf", init=hf_dirs["llama"])
    plain = build_policy(cfg, tiny_tokenizer)
    compiled = build_policy(dataclasses.replace(cfg, compile=False), tiny_tokenizer)
    compiled.module.load_state_dict(plain.module.state_dict())
    compiled.model_cfg = dataclasses.replace(cfg, compile=True)
    seen, masks = [], []

    def runner(*args, **kwargs):  # stands in for torch.compile(module): records what it is called with
        ids = kwargs.get("input_ids", args[0] if args else None)
        if "attention_mask" in kwargs:
            masks.append(tuple(kwargs["attention_mask"].shape))
        seen.append((ids.shape[1], kwargs.get("logits_from", ids.shape[1] - kwargs.get("logits_to_keep", ids.shape[1]))))
        return compiled.module(*args, **kwargs)

    class Runner(torch.nn.Module):  # what Policy and HFOps see of torch.compile's wrapper: `_orig_mod`
        def __init__(self):
            super().__init__()
            self._orig_mod = compiled.module

        def forward(self, *args, **kwargs):
            return runner(*args, **kwargs)

    compiled.runner = Runner()
    g = torch.Generator().manual_seed(0)
    for T, start in ((20, 9), (37, 15), (70, 66)):
        ids = torch.randint(3, tiny_tokenizer.vocab_size, (3, T), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        with torch.no_grad():
            want = plain.token_logprobs(ids, mask, start=start)
            got = compiled.token_logprobs(ids, mask, start=start, group_size=3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert [w for w, _ in seen] == [64, 64, 128]
    assert all(frm % COMPILE_BUCKET == 0 for _, frm in seen)
    if backend == "hf":  # a compiled forward always gets the 4-D self-attending mask (pipeline.model.hf)
        assert masks == [(3, 1, 64, 64), (3, 1, 64, 64), (3, 1, 128, 128)]
