"""LoRA (peft), bf16 weights and gradient checkpointing on tiny HF models built from a config:
only adapter weights train, the reference is the base with adapters off (no second copy), the
merged export loads with `AutoModelForCausalLM.from_pretrained` and gives the trained policy's
logits, resume restores the adapters exactly, checkpointing leaves gradients unchanged."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import reward_of, tiny_model_config

pytest.importorskip("peft")

from pipeline.model.lora import AdaptersOff, add_lora, is_lora  # noqa: E402
from pipeline.model.policy import build_policy  # noqa: E402
from pipeline.train.checkpoint import load_policy, save_policy  # noqa: E402
from pipeline.train.optim import build_optimizer  # noqa: E402
from pipeline.train.state import load_training_state, save_training_state

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=["q_proj", "v_proj", "o_proj"])


def batch(V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def train_a_few_steps(policy, steps: int = 3):
    ids, mask = batch(policy.tokenizer.vocab_size)
    opt = build_optimizer(policy.module, 5e-2, 0.0)
    for _ in range(steps):
        loss = -policy.token_logprobs(ids, mask, start=4).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


@pytest.fixture(params=["qwen2", "llama"])
def lora_policy(request, hf_dirs):
    torch.manual_seed(0)
    cfg = tiny_model_config(backend="hf", init=hf_dirs[request.param], **LORA)
    policy = build_policy(cfg)
    add_lora(policy, cfg)
    return policy, hf_dirs[request.param]


def test_only_adapter_weights_change_and_the_reference_is_the_base(lora_policy):
    policy, init = lora_policy
    base = {k: v.clone() for k, v in policy.module.get_base_model().state_dict().items() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in policy.module.state_dict().items() if "lora_B" in k}
    train_a_few_steps(policy)
    after = policy.module.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base is frozen
    assert all(not torch.equal(policy.module.state_dict()[k], v) for k, v in lora_before.items())
    trainable = [n for n, p in policy.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    ids, mask = batch(policy.tokenizer.vocab_size, seed=1)
    ref = AdaptersOff(policy)
    fresh = build_policy(tiny_model_config(backend="hf", init=init))
    with torch.no_grad():
        torch.testing.assert_close(ref.token_logprobs(ids, mask, start=4), fresh.token_logprobs(ids, mask, start=4),
                                   atol=1e-6, rtol=0)
        trained = policy.token_logprobs(ids, mask, start=4)
    assert not torch.allclose(trained, fresh.token_logprobs(ids, mask, start=4), atol=1e-4)
    assert ref.policy.module is policy.module  # one copy of the base


def test_merged_export_loads_with_from_pretrained_and_gives_the_same_logits(lora_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    policy, _ = lora_policy
    train_a_few_steps(policy)
    save_policy(tmp_path / "ckpt", policy)
    assert not (tmp_path / "ckpt" / "adapter_config.json").exists()  # merged, not an adapter folder
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids, mask = batch(policy.tokenizer.vocab_size, seed=2)
    with torch.no_grad():
        ours = policy.logits(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        real = mask.bool()  # a pad's logits are nobody's (the policy lets a left pad's query see itself)
        torch.testing.assert_close(theirs[real], ours[real], atol=1e-5, rtol=0)
        loaded = load_policy(tmp_path / "ckpt", device="cpu")
        assert not is_lora(loaded.module)
        torch.testing.assert_close(loaded.logits(ids, mask), ours, atol=1e-5, rtol=0)


def test_resume_state_restores_the_adapters_exactly(lora_policy, tmp_path):
    policy, init = lora_policy
    opt = train_a_few_steps(policy)
    save_training_state(tmp_path / "state", policy, opt, None, None, {"it": 3})
    cfg = tiny_model_config(backend="hf", init=init, **LORA)
    fresh = build_policy(cfg)
    add_lora(fresh, cfg)
    fresh_opt = build_optimizer(fresh.module, 5e-2, 0.0)
    state = load_training_state(tmp_path / "state", fresh, fresh_opt)
    assert state["extra"] == {"it": 3}
    for (k, a), b in zip(policy.module.state_dict().items(), fresh.module.state_dict().values()):
        assert torch.equal(a, b), k
    train_a_few_steps(policy, 1)
    train_a_few_steps(fresh, 1)  # the same next step: optimizer moments restored too
    assert all(torch.equal(a, b) for a, b in zip(policy.module.state_dict().values(), fresh.module.state_dict().values()))


def test_bf16_weights_train_and_are_saved_in_bf16(hf_dirs, tmp_path):
    from safetensors import safe_open

    cfg = tiny_model_config(backend="hf", init=hf_dirs["qwen2"], param_dtype="bfloat16")
    policy = build_policy(cfg)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    train_a_few_steps(policy, 1)
    save_policy(tmp_path / "ckpt", policy)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert {p.dtype for p in load_policy(tmp_path / "ckpt", device="cpu").parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_gradient_checkpointing_gives_the_same_gradients(hf_dirs, kind):
    """Same gradients (the GRPO update's call: eval mode, groups sharing a prompt), and each layer's
    attention really runs twice: once in forward, once recomputed in backward."""
    grads, calls = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind], gradient_checkpointing=recompute))
        policy.eval()
        assert policy.recompute == recompute
        attn = [m for n, m in policy.module.named_modules() if n.endswith(("self_attn", ".attn"))][0]
        count = []
        attn.register_forward_hook(lambda *a: count.append(1))
        ids, mask = batch(policy.tokenizer.vocab_size)
        ids = ids.repeat_interleave(2, 0)  # groups of 2 sharing a prompt (the shared path gives way under recompute)
        mask = mask.repeat_interleave(2, 0)
        policy.token_logprobs(ids, mask, start=4, group_size=2).sum().backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
        calls.append(len(count))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert calls[1] == 2 and calls[0] in (1, 2)  # plain: one forward (2: the shared path's prompt + responses)


def _rows(n: int) -> list[dict]:
    return [{"id": f"g{i}", "source": "gsm8k", "question": f"What is {i} + 2?", "prompt": f"Question: {i} + 2?\nAnswer:",
             "gold": float(i + 2), "solution": f"<answer>{i + 2}</answer>", "level": 0} for i in range(n)]


def test_grpo_stage_with_lora_writes_a_merged_checkpoint(hf_dirs, tmp_path, monkeypatch):
    """The grpo stage with model.lora_rank > 0: adapters on the init model, the KL reference is
    that model with adapters off, and checkpoints/grpo is a plain transformers folder whose
    untargeted weights are the init's."""
    from safetensors.torch import load_file

    from pipeline.core.config_loading import config_from_dict
    from pipeline.stages.grpo import run_grpo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("gsm8k_train", "gsm8k_val"):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(8)))
    model = dataclasses.asdict(tiny_model_config(backend="hf", init=hf_dirs["llama"], **LORA))
    init = build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"]))
    for stage in ("sft", "warmup"):
        save_policy(tmp_path / "checkpoints" / stage, init)
    cfg = config_from_dict({"model": model, "sft": {"max_len": 64}, "warmup": {"rollout_len": 8},
                            "grpo": {"iterations": 2, "prompts_per_iter": 2, "group_size": 2, "rollout_len": 6,
                                     "eval_every": 0, "save_every": 1, "lr": 1e-2, "kl_coef": 0.1},
                            "tracking": {"enabled": False}})
    summary = run_grpo(cfg, "grpo", rewards=reward_of(lambda text, gold: float(len(text) % 2)))  # has variance
    assert summary["iterations"] == 2
    before = load_file(tmp_path / "checkpoints" / "warmup" / "model.safetensors")
    after = load_file(tmp_path / "checkpoints" / "grpo" / "model.safetensors")
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(t in k for t in LORA["lora_targets"]) for k in changed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_bf16_update_on_cuda(hf_dirs, tmp_path):
    """On CUDA with bf16 weights and autocast: the adapters train, the base stays, the merged export loads."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_model_config(backend="hf", init=hf_dirs["qwen2"], device="cuda", dtype="bfloat16",
                            param_dtype="bfloat16", **LORA)
    policy = build_policy(cfg)
    add_lora(policy, cfg)
    base = {k: v.clone() for k, v in policy.module.get_base_model().state_dict().items() if "lora_" not in k}
    ids, mask = (t.cuda() for t in batch(policy.tokenizer.vocab_size))
    opt = build_optimizer(policy.module, 5e-2, 0.0)
    for _ in range(2):
        loss = -policy.token_logprobs(ids, mask, start=4).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = policy.module.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    save_policy(tmp_path / "ckpt", policy)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").dtype == torch.bfloat16


def test_grpo_runs_a_lora_policy_with_dropout_off_and_its_reference_is_the_base(hf_dirs, tmp_path, monkeypatch):
    """A GPT-2 with dropout (0.1 in every layer) under LoRA through the grpo stage's set-up and one
    iteration: every module stays in eval mode after the rollout and the update, the policy's
    log-probs are deterministic, and the reference (adapters off) is exactly the frozen base, the
    reference of a run without LoRA (frozen: a weight that requires grad can take another matmul path)."""
    from pipeline.core.config_loading import config_from_dict
    from pipeline.rl.rollout import rollout_prompts
    from pipeline.stages.grpo import TrainState, grpo_iteration, setup

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("gsm8k_train", "gsm8k_val"):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(4)))
    base = build_policy(tiny_model_config(backend="hf", init=hf_dirs["gpt2"])).eval()
    assert base.module.config.resid_pdrop > 0 and base.module.config.attn_pdrop > 0
    for stage in ("sft", "warmup"):
        save_policy(tmp_path / "checkpoints" / stage, base)
    lora = dict(LORA, lora_targets=["c_attn"])
    cfg = config_from_dict({"model": dataclasses.asdict(tiny_model_config(backend="hf", init=hf_dirs["gpt2"], **lora)),
                            "sft": {"max_len": 64}, "warmup": {"rollout_len": 8},
                            "grpo": {"iterations": 1, "prompts_per_iter": 2, "group_size": 2, "rollout_len": 6,
                                     "eval_every": 0, "lr": 1e-2, "kl_coef": 0.1},
                            "tracking": {"enabled": False}})
    run = setup(cfg, "grpo", reward_of(lambda text, gold: float(len(text) % 2)))
    grpo_iteration(run, TrainState(total_iters=1))
    assert not any(m.training for m in run.policy.module.modules())
    ro = rollout_prompts(run.policy, [r["prompt"] for r in _rows(2)], 2, 6, generator=torch.Generator().manual_seed(0))
    assert not any(m.training for m in run.policy.module.modules())
    with torch.no_grad():
        ids, mask, start = ro.input_ids, ro.attention_mask, ro.prompt_len
        first = run.policy.token_logprobs(ids, mask, start=start, group_size=2)
        assert torch.equal(first, run.policy.token_logprobs(ids, mask, start=start, group_size=2))
        assert torch.equal(run.ref.token_logprobs(ids, mask, start=start, group_size=2),
                           base.frozen_copy().token_logprobs(ids, mask, start=start, group_size=2))
