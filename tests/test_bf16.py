"""bf16 autocast on CPU (`model.dtype: bfloat16`, fp32 master weights) against fp32 on the smoke
warmup: the per-iteration reward and KL stay within a stated tolerance. bf16 weights
(`model.param_dtype: bfloat16`): the optimizer steps fp32 masters, so a 1e-6 update lands as in fp32,
the weights are the masters rounded, and a resumed run continues from the same masters."""

from __future__ import annotations

import pytest

from tests.conftest import reward_of, smoke_cfg, tiny_model_config

REWARD_TOL = 0.25  # mean reward of a 3-iteration run, rewards in [0, 1]: sampling diverges under bf16
KL_TOL = 0.02  # per-iteration KL to the reference (0 at the first iteration on both)


_parity_reward = reward_of(lambda text, gold: float(len(text) % 2))  # odd-length texts score 1: variance


def _run(workdir, dtype: str) -> list[dict[str, float]]:
    from pipeline.stages.grpo import run_grpo

    run_grpo(smoke_cfg("warmup.iterations=3", f"model.dtype={dtype}"), "warmup", rewards=_parity_reward)
    lines = (workdir / "plots" / "warmup.csv").read_text().splitlines()
    return [{k: float(v) for k, v in zip(lines[0].split(","), line.split(",")) if k in ("reward", "kl")}
            for line in lines[1:]]


@pytest.mark.slow
def test_bf16_rewards_and_kl_stay_near_fp32(grpo_workdir):
    fp32, bf16 = _run(grpo_workdir, "float32"), _run(grpo_workdir, "bfloat16")
    assert len(fp32) == len(bf16) == 3
    assert fp32 != bf16  # bf16 really ran: its rounding moves the figures
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert abs(mean(fp32, "reward") - mean(bf16, "reward")) <= REWARD_TOL, (fp32, bf16)
    for a, b in zip(fp32, bf16):
        assert abs(a["kl"] - b["kl"]) <= KL_TOL, (fp32, bf16)


# --------------------------------------------------------------------------- bf16 weights: fp32 master copy

LR, STEPS = 1e-6, 6  # the fine-tuning LR of configs/instruct.yaml; the steps of the measurement


def _pair(kind: str, tiny_tokenizer, hf_dirs, device: str = "cpu"):
    """A bf16-weight policy and an fp32 one holding the same (bf16-representable) values."""
    import torch

    from pipeline.model.policy import build_policy

    extra = {} if kind == "gpt" else dict(backend="hf", init=hf_dirs[kind])
    torch.manual_seed(0)
    bf16 = build_policy(tiny_model_config(param_dtype="bfloat16", device=device, **extra), tiny_tokenizer)
    fp32 = build_policy(tiny_model_config(device=device, **extra), tiny_tokenizer)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    return bf16, fp32


def _train(policy, steps: int = STEPS, lr: float = LR, optimizer=None):
    """`steps` AdamW steps (the stages' optimizer and step) on one fixed batch's next-token loss."""
    import torch

    from pipeline.train.optim import build_optimizer, step_if_finite

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, policy.tokenizer.vocab_size, (4, 16), generator=g).to(policy.device)
    mask = torch.ones_like(ids)
    opt = optimizer or build_optimizer(policy.module, lr, 0.0)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = -policy.token_logprobs(ids, mask, start=4).mean()
        loss.backward()
        assert step_if_finite(opt, policy.module.parameters(), 1.0, loss) is not None
    return opt


def _stepped(optimizer) -> list:
    """The tensors AdamW steps on (fp32 masters where the weights are bf16)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _in_optimizer_order(policy) -> list:
    """The trainable weights in the order the optimizer holds them (`param_groups`)."""
    from pipeline.train.optim import param_groups

    return [p for group in param_groups(policy.module, 0.0) for p in group["params"]]


def _changed(before: list, after: list) -> float:
    """Fraction of the elements that moved."""
    moved = sum(int((a.float() != b.float()).sum()) for a, b in zip(before, after))
    return moved / sum(a.numel() for a in before)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_1e_6_update_lands_on_bf16_weights(kind, tiny_tokenizer, hf_dirs):
    """bf16 weights at lr 1e-6: an update is ~1/40 of a bf16 step at |w| = 0.02, so plain bf16 AdamW
    rounded ~98% of them away (2.0% of the weights moved in 6 steps). With an fp32 master copy the
    weights AdamW steps move as many as in fp32, by as much, and the bf16 weights are exactly the
    masters rounded to nearest (what the forward uses)."""
    import torch

    bf16, fp32 = _pair(kind, tiny_tokenizer, hf_dirs)
    weights = _in_optimizer_order(bf16)
    init = [w.detach().float().clone() for w in weights]
    masters, reference = _stepped(_train(bf16)), _stepped(_train(fp32))
    ours, fp32_share = _changed(init, masters), _changed(init, reference)
    assert fp32_share > 0.75  # every weight with a gradient (Llama: the unused embedding rows have none)
    assert ours >= fp32_share - 0.005, f"updates rounded away: {ours:.1%} of the weights moved, fp32 {fp32_share:.1%}"
    moved = lambda ws: sum(float((w.detach().float() - i).abs().sum()) for w, i in zip(ws, init))  # noqa: E731
    assert moved(masters) == pytest.approx(moved(reference), rel=0.1)  # as far as in fp32
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(w.dtype == torch.bfloat16 and torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(weights, masters))


def test_fp32_weights_keep_plain_adamw(gpt_policy):
    """The default (fp32 weights) steps the parameters themselves with torch's AdamW: no copy, the
    same bytes as before."""
    import torch

    from pipeline.train.optim import build_optimizer

    opt = build_optimizer(gpt_policy.module, LR, 0.1)
    assert type(opt) is torch.optim.AdamW
    assert {id(p) for p in _stepped(opt)} == {id(p) for p in gpt_policy.module.parameters()}


def test_bf16_resume_state_carries_the_masters(tiny_tokenizer, hf_dirs, tmp_path):
    """A resume state of a bf16 run holds the fp32 masters: a run restored from it continues bit for
    bit like the uninterrupted one (restarting from the bf16 weights would lose every update not yet
    big enough to show in them, i.e. nearly all at 1e-6)."""
    import torch

    from pipeline.train.state import load_training_state, save_training_state

    whole, _ = _pair("gpt", tiny_tokenizer, hf_dirs)
    opt = _train(whole, steps=3)
    save_training_state(tmp_path / "state", whole, opt, None, None, None)
    _train(whole, steps=3, optimizer=opt)

    resumed, _ = _pair("gpt", tiny_tokenizer, hf_dirs)
    from pipeline.train.optim import build_optimizer

    opt2 = build_optimizer(resumed.module, LR, 0.0)
    load_training_state(tmp_path / "state", resumed, opt2)
    _train(resumed, steps=3, optimizer=opt2)
    for a, b in zip([*whole.module.parameters(), *_stepped(opt)], [*resumed.module.parameters(), *_stepped(opt2)]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_killed_bf16_sft_resumes_bit_identically(grpo_workdir, monkeypatch, caplog):
    """The SFT stage with bf16 weights at lr 1e-6, stopped right after its step-8 resume state and run
    again, ends with the weights and series of an uninterrupted run, bit for bit: at this LR nearly
    every update so far lives in the masters alone, so restarting from the bf16 weights would not."""
    from pipeline.stages import sft

    cfg = smoke_cfg("model.param_dtype=bfloat16", "sft.lr=1e-6", "sft.steps=12", "sft.save_every=4",
                    "sft.eval_every=0", "sft.log_every=1")
    sft.run_sft(cfg)
    out, csv = grpo_workdir / "checkpoints/sft/model.safetensors", grpo_workdir / "plots/sft.csv"
    whole, series = out.read_bytes(), csv.read_text()

    class Killed(Exception):
        pass

    real = sft.save_resume

    def save_then_die(folder, step, *a, **k):
        real(folder, step, *a, **k)
        if step == 8:
            raise Killed

    monkeypatch.setattr(sft, "save_resume", save_then_die)
    with pytest.raises(Killed):
        sft.run_sft(cfg)
    monkeypatch.setattr(sft, "save_resume", real)
    with caplog.at_level("INFO", logger="pipeline"):
        sft.run_sft(cfg)
    assert "resuming from checkpoints/sft.resume/step_000008" in caplog.text
    assert out.read_bytes() == whole and csv.read_text() == series


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_1e_6_update_lands_on_bf16_weights_on_cuda(tiny_tokenizer, hf_dirs):
    """The same on the GPU (where bf16 weights are used): the masters move as many weights as fp32."""
    bf16, fp32 = _pair("llama", tiny_tokenizer, hf_dirs, device="cuda")
    init = [w.detach().float().clone() for w in _in_optimizer_order(bf16)]
    masters, reference = _stepped(_train(bf16)), _stepped(_train(fp32))
    assert _changed(init, masters) >= _changed(init, reference) - 0.005 and _changed(init, reference) > 0.75
