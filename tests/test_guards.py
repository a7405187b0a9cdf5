"""Training guards: an update that blows the weights up stops the stage with one line before anything
is saved; a blown-up state on disk is never resumed; model.* and the reference must agree with the
checkpoint warmup/grpo continue."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.core.errors import CheckpointError, InputError, TrainingDivergedError
from pipeline.train.optim import WEIGHT_LIMIT, build_optimizer, step_if_finite
from tests.conftest import GSM8K, smoke_cfg, weights
from tests.conftest import REPO as ROOT


@pytest.fixture
def workdir(grpo_workdir):
    return grpo_workdir


def _step(lr: float):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = build_optimizer(net, lr=lr, weight_decay=0.0)
    loss = net(torch.ones(2, 4)).pow(2).sum()
    loss.backward()
    return net, step_if_finite(opt, net.parameters(), 1.0, loss)


def test_a_finite_but_exploding_step_is_caught_after_the_update():
    net, norm = _step(1e-3)
    assert norm is not None and net.weight.abs().max() < 10
    with pytest.raises(TrainingDivergedError, match=r"the update made the weights explode \(\|w\| = 1e\+09\) at lr = 1e\+09"):
        _step(1e9)


def test_the_sampler_never_returns_an_index_outside_the_vocabulary():
    from pipeline.rl.rollout import sample_next

    logits = torch.full((3, 400), float("nan"))
    logits[1] = torch.randn(400)
    tokens, logp = sample_next(logits, generator=torch.Generator().manual_seed(0))
    assert int(tokens.max()) < 400 and torch.isnan(logp[0]) and torch.isfinite(logp[1])


def _resume_states_are_sane(folder):
    for step in folder.glob("step_*") if folder.is_dir() else []:
        for t in weights(step).values():
            assert torch.isfinite(t).all() and t.abs().max() <= WEIGHT_LIMIT


def test_lr_1e9_stops_with_one_line_and_saves_nothing_blown_up(workdir):
    from pipeline.stages.grpo import run_grpo

    cfg = smoke_cfg("grpo.lr=1e9", "grpo.iterations=3", "grpo.save_every=1")
    with pytest.raises(TrainingDivergedError, match="lower the stage's lr") as info:
        run_grpo(cfg, "grpo")  # the warmup checkpoint differs from the reference: the KL term moves it
    assert "\n" not in str(info.value)
    assert not (workdir / "checkpoints" / "grpo").exists()
    _resume_states_are_sane(workdir / "checkpoints" / "grpo.resume")


@pytest.mark.slow
def test_cli_lr_1e9_is_one_line_exit_2_and_a_rerun_can_continue(workdir):
    def cli(*sets):
        args = [sys.executable, "-m", "pipeline", "grpo", "--params", str(ROOT / "configs" / "smoke.yaml"),
                "--set", f"data.gsm8k_source={GSM8K}", "--set", "grpo.save_every=1", *sets]
        return subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    res = cli("--set", "grpo.lr=1e9")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: the update made the weights explode")
    _resume_states_are_sane(workdir / "checkpoints" / "grpo.resume")
    res = cli()
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["iterations"] == 2


def test_a_blown_up_resume_state_is_never_resumed(workdir):
    from pipeline.stages.grpo import TrainState
    from pipeline.train.checkpoint import load_policy
    from pipeline.train.resume import load_resume, save_resume

    policy = load_policy(workdir / "checkpoints" / "warmup", device="cpu")
    opt = build_optimizer(policy.module, 1e-3, 0.0)
    good = {k: v.clone() for k, v in policy.module.state_dict().items()}
    with torch.no_grad():
        next(policy.module.parameters()).mul_(1e9)
    save_resume(workdir / "r", 1, "k", TrainState(total_iters=3, iteration=1), policy, opt, None, keep_last=2)
    with torch.no_grad():
        policy.module.load_state_dict(good)
    assert load_resume(workdir / "r", "k", TrainState, policy, opt, None) is None
    assert all(torch.equal(good[k], v) for k, v in policy.module.state_dict().items())  # untouched
    with pytest.raises(CheckpointError, match="holds non-finite or exploded weights"):
        from pipeline.train.state import load_training_state

        load_training_state(workdir / "r" / "step_000001", policy, opt)


def test_states_of_other_params_do_not_push_out_a_new_runs_states(workdir):
    """A run dies at iteration 157 (states 140 and 150 kept) and is re-run with other params (a lower
    lr, as the divergence message advises): its key differs, so it starts over, and its own states
    10, 20, 30 are kept by keep_last=2 (the old ones, newer by name, once made each new state be
    deleted as soon as it was written, so a kill restarted from 0 again)."""
    from pipeline.stages.grpo import TrainState
    from pipeline.train.checkpoint import load_policy
    from pipeline.train.resume import load_resume, save_resume

    policy = load_policy(workdir / "checkpoints" / "warmup", device="cpu")
    opt = build_optimizer(policy.module, 1e-3, 0.0)
    folder = workdir / "r"
    for it in (140, 150):
        save_resume(folder, it, "old", TrainState(total_iters=200, iteration=it), policy, opt, None, keep_last=2)
    for it in (10, 20, 30):
        save_resume(folder, it, "new", TrainState(total_iters=200, iteration=it), policy, opt, None, keep_last=2)
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_000020", "step_000030", "step_000140",
                                                              "step_000150"]
    assert load_resume(folder, "new", TrainState, policy, opt, None).iteration == 30
    assert load_resume(folder, "old", TrainState, policy, opt, None).iteration == 150


@pytest.mark.parametrize("override,pattern", [
    ("model.n_embd=256", r"model.n_embd = 256 in the params, but checkpoints/warmup was written with model.n_embd = 32"),
    ("model.n_layer=3", r"model.n_layer = 3 in the params, but checkpoints/warmup was written with model.n_layer = 2"),
    ("model.positions=learned", r"model.positions = 'learned' in the params"),
])
def test_model_params_that_disagree_with_the_checkpoint_are_refused(workdir, override, pattern):
    from pipeline.stages.grpo import run_grpo

    with pytest.raises(InputError, match=pattern):
        run_grpo(smoke_cfg(override), "grpo")


def test_a_reference_of_another_architecture_is_refused(workdir):
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.stages.grpo import run_grpo
    from pipeline.train.checkpoint import save_policy

    cfg = smoke_cfg()
    other = build_policy(smoke_cfg("model.n_embd=64").model, load_tokenizer(workdir / "data" / "tokenizer.json"))
    save_policy(workdir / "checkpoints" / "sft", other)
    with pytest.raises(InputError, match=r"model.n_embd = 32 in checkpoints/warmup \(the policy\), but "
                                         r"checkpoints/sft was written with model.n_embd = 64"):
        run_grpo(cfg, "grpo")
    run_grpo(smoke_cfg("grpo.kl_coef=0"), "grpo")  # no KL, no reference: nothing to disagree with


def test_an_unknown_device_is_refused_by_the_config():
    from pipeline.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.device = 'cudaXYZ' is out of range; allowed: auto, cpu, cuda or cuda:N"):
        smoke_cfg("model.device=cudaXYZ")


def test_a_resume_state_moved_in_from_another_seed_or_stage_is_not_resumed(workdir):
    """Resume folders swapped between seeds or stages (a copy, a restore from a backup, a rename): the
    state is keyed by the stage's params, the model and the bytes of its inputs, so a state of
    another seed or of the other GRPO stage is ignored (the run starts at iteration 0), not
    continued as if it were this run's."""
    import shutil

    from pipeline.stages.grpo import TrainState, compatibility_key, setup
    from pipeline.train.resume import load_resume, save_resume

    runs = {"warmup seed 0": setup(smoke_cfg(), "warmup"), "warmup seed 1": setup(smoke_cfg("warmup.seed=1"), "warmup"),
            "grpo seed 0": setup(smoke_cfg(), "grpo")}
    keys = {name: compatibility_key(run) for name, run in runs.items()}
    assert len(set(keys.values())) == 3
    mine = runs["warmup seed 0"]
    save_resume(workdir / "elsewhere", 7, keys["warmup seed 0"], TrainState(total_iters=9, iteration=7), mine.policy,
                mine.optimizer, mine.generator, keep_last=2)
    for name in ("warmup seed 1", "grpo seed 0"):  # the seed-0 warmup's state moved into their resume folder
        run = runs[name]
        shutil.rmtree(run.paths.resume, ignore_errors=True)
        shutil.copytree(workdir / "elsewhere", run.paths.resume)
        assert load_resume(run.paths.resume, keys[name], TrainState, run.policy, run.optimizer, run.generator) is None
    assert load_resume(workdir / "elsewhere", keys["warmup seed 0"], TrainState, mine.policy, mine.optimizer,
                       mine.generator).iteration == 7
