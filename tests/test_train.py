"""GRPO stages on the smoke params: finite metrics, whole-group minibatches, frozen reference,
bit-exact kill-and-resume, DDP (gloo, 2 processes) == 1 process, non-finite steps skipped."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tests.conftest import GSM8K, kill_tree_at, reward_of, smoke_cfg, weights
from tests.conftest import REPO as ROOT


@pytest.fixture
def workdir(grpo_workdir):
    return grpo_workdir




_parity_reward = reward_of(lambda text, gold: float(len(text) % 2))  # odd-length texts score 1: variance


def run_warmup(cfg, **kw):
    from pipeline.stages.grpo import run_grpo

    return run_grpo(cfg, "warmup", **kw)


def test_warmup_runs_metrics_finite_policy_changes_reference_frozen(workdir):
    before = weights(workdir / "checkpoints" / "sft")
    # a random policy never answers right: all groups would be uninformative and nothing would move
    summary = run_warmup(smoke_cfg("warmup.iterations=3"), rewards=_parity_reward)
    assert summary["iterations"] == 3
    after = weights(workdir / "checkpoints" / "warmup")
    assert any(not torch.equal(before[k], after[k]) for k in before), "the policy did not change"
    # the reference (SFT checkpoint) is never written by GRPO
    assert all(torch.equal(before[k], v) for k, v in weights(workdir / "checkpoints" / "sft").items())
    lines = (workdir / "plots" / "warmup.csv").read_text().splitlines()
    assert lines[0].startswith("iteration,reward,reward_std,informative,kl,clipfrac")
    assert len(lines) == 1 + 3
    assert summary["reward_first"] is not None and 0.0 <= summary["reward_first"] <= 1.0
    for line in lines[1:]:
        cells = dict(zip(lines[0].split(","), line.split(",")))
        for k in ("reward", "informative", "kl", "loss", "grad_norm", "entropy", "lr"):
            assert cells[k] != "" and torch.isfinite(torch.tensor(float(cells[k]))), (k, cells)
    assert not (workdir / "checkpoints" / "warmup.resume").exists()


def test_resume_state_from_other_params_is_ignored(workdir, monkeypatch, caplog):
    """A resume state left by a run with other params is not continued (its key differs); one
    from the same params is. Whether a finished stage re-runs at all is DVC's decision."""
    from pipeline.stages import grpo

    class Killed(Exception):
        pass

    def stop_after_save(*a, **k):  # a "kill" right after the first resume state is written
        real_save(*a, **k)
        raise Killed

    real_save = grpo.save_resume
    monkeypatch.setattr(grpo, "save_resume", stop_after_save)
    with pytest.raises(Killed):
        run_warmup(smoke_cfg("warmup.iterations=3", "warmup.eval_every=0"))
    assert list((workdir / "checkpoints" / "warmup.resume").glob("step_*"))
    monkeypatch.setattr(grpo, "save_resume", real_save)
    with caplog.at_level("INFO", logger="pipeline"):
        summary = run_warmup(smoke_cfg("warmup.iterations=3", "warmup.eval_every=0", "warmup.lr=2e-4"))
    assert "ignoring resume state" in caplog.text and "resuming from" not in caplog.text
    assert summary["iterations"] == 3 and len(_csv_rows(workdir / "plots" / "warmup.csv")) == 3

    monkeypatch.setattr(grpo, "save_resume", stop_after_save)
    with pytest.raises(Killed):
        run_warmup(smoke_cfg("warmup.iterations=3", "warmup.eval_every=0"))
    monkeypatch.setattr(grpo, "save_resume", real_save)
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        run_warmup(smoke_cfg("warmup.iterations=3", "warmup.eval_every=0"))
    assert "resuming from" in caplog.text


def test_minibatches_hold_whole_groups(workdir, monkeypatch):
    """Each minibatch (one group here) gets exactly one group's advantages, and each epoch covers
    every group once. The parity verifier gives a random policy rewards with variance, so the
    groups' advantages differ and are not all 0."""
    from pipeline.rl import update
    from pipeline.stages import grpo

    seen, computed = [], []
    real_loss, real_adv = update.grpo_loss, grpo.group_advantages

    def spy(new, old, ref, adv, mask, **kw):
        seen.append(adv.detach().clone())
        return real_loss(new, old, ref, adv, mask, **kw)

    def spy_adv(rewards, group_size, **kw):
        computed.append(real_adv(rewards, group_size, **kw))
        return computed[-1]

    monkeypatch.setattr(update, "grpo_loss", spy)
    monkeypatch.setattr(grpo, "group_advantages", spy_adv)
    cfg = smoke_cfg("warmup.iterations=1", "warmup.prompts_per_iter=4", "warmup.minibatch_groups=1",
                    "warmup.grpo_epochs=2")
    run_warmup(cfg, rewards=_parity_reward)
    G = cfg.warmup.group_size
    assert len(computed) == 1 and computed[0].numel() == 4 * G
    chunks = [computed[0][g * G:(g + 1) * G] for g in range(4)]
    assert any(c.abs().sum() > 0 for c in chunks)
    assert len(seen) == 2 * 4  # epochs x minibatches
    for epoch in range(2):
        got = seen[epoch * 4:(epoch + 1) * 4]
        # each minibatch is one group's advantages, and the epoch uses every group exactly once
        assert sorted(tuple(a.tolist()) for a in got) == sorted(tuple(c.tolist()) for c in chunks)
    for adv in seen:
        assert adv.numel() == G
        assert abs(adv.sum().item()) < 1e-4  # a whole group's centred advantages sum to zero


def test_all_wrong_groups_give_zero_policy_gradient(workdir, monkeypatch):
    """Every completion scores 0: advantages are 0, so with kl_coef 0 the gradient is exactly 0."""
    grads = []
    real_step = torch.optim.AdamW.step

    def spy_step(self, *a, **k):
        grads.append(max(p.grad.abs().max().item() for g in self.param_groups for p in g["params"]
                         if p.grad is not None))
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)
    summary = run_warmup(smoke_cfg("warmup.iterations=2", "warmup.kl_coef=0"),
                         rewards=reward_of(lambda text, gold: 0.0))
    assert grads == [0.0, 0.0]
    assert summary["reward_last"] == 0.0


def test_forced_nan_is_skipped_and_counted_then_stops(workdir, monkeypatch):
    from pipeline.core.errors import TrainingDivergedError
    from pipeline.rl import update

    real = update.grpo_loss
    calls = {"n": 0}

    def nan_first(*a, **k):
        calls["n"] += 1
        loss, st = real(*a, **k)
        return (loss * float("nan") if calls["n"] == 1 else loss), st

    monkeypatch.setattr(update, "grpo_loss", nan_first)
    summary = run_warmup(smoke_cfg("warmup.iterations=3"))
    assert summary["skipped_steps"] == 1
    rows = (workdir / "plots" / "warmup.csv").read_text().splitlines()
    assert rows[-1].split(",")[rows[0].split(",").index("skipped_steps")] == "1"

    monkeypatch.setattr(update, "grpo_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), {}))
    with pytest.raises(TrainingDivergedError, match="consecutive non-finite"):
        run_warmup(smoke_cfg("warmup.iterations=5", "warmup.max_nonfinite=2", "warmup.seed=1"))


def _run_cli(stage: str, *overrides: str, cwd: Path, wait: bool = True, args: tuple[str, ...] = ()):
    cmd = [sys.executable, "-m", "pipeline", stage, "--params", str(ROOT / "configs" / "smoke.yaml"),
           "--set", f"data.gsm8k_source={GSM8K}", *[x for o in overrides for x in ("--set", o)], *args]
    # one intra-op thread: bit-exactness across processes holds for a fixed thread count, and
    # multi-threaded BLAS on a loaded 2-core machine may split reductions differently run to run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if wait:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(workdir, tmp_path):
    """SIGKILL mid-run, re-run: final weights equal those of an uninterrupted run, bit for bit."""
    overrides = ("grpo.iterations=6", "grpo.save_every=2", "grpo.eval_every=0")
    ref_dir = tmp_path / "uninterrupted"
    shutil.copytree(workdir, ref_dir)
    res = _run_cli("grpo", *overrides, cwd=ref_dir)
    assert res.returncode == 0, res.stderr
    start = weights(workdir / "checkpoints" / "warmup")
    end = weights(ref_dir / "checkpoints" / "grpo")
    assert any(not torch.equal(start[k], end[k]) for k in start), "weights must move for the test to mean anything"

    proc = _run_cli("grpo", *overrides, cwd=workdir, wait=False)
    resume = workdir / "checkpoints" / "grpo.resume"
    deadline = time.time() + 240
    while time.time() < deadline and not any(resume.glob("step_000004")):
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be killed: {proc.stdout.read()}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (workdir / "checkpoints" / "grpo").exists()
    res = _run_cli("grpo", *overrides, cwd=workdir)
    assert res.returncode == 0, res.stderr
    assert "resuming from" in res.stderr
    a, b = weights(ref_dir / "checkpoints" / "grpo"), weights(workdir / "checkpoints" / "grpo")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _series(ref_dir / "plots" / "grpo.csv") == _series(workdir / "plots" / "grpo.csv")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_kill_and_resume_is_bit_identical_per_rank(workdir, tmp_path, parallel):
    """2 processes (gloo): SIGKILL the CLI, torchrun and both ranks mid-run, re-run: the final weights and
    series equal an uninterrupted 2-process run's. Each rank resumes with its own sampling RNG
    (rank 0 writes every rank's), not rank 0's. Under FSDP the resume state holds the whole weights and
    the full optimizer state, and each rank shards them again."""
    overrides = ("grpo.nproc=2", "grpo.iterations=8", "grpo.save_every=2", "grpo.eval_every=0",
                 f"grpo.parallel={parallel}")
    ref_dir = tmp_path / "uninterrupted"
    shutil.copytree(workdir, ref_dir)
    res = _run_cli("grpo", *overrides, cwd=ref_dir)
    assert res.returncode == 0, res.stderr[-3000:]

    cmd = [sys.executable, "-m", "pipeline", "grpo", "--params", str(ROOT / "configs" / "smoke.yaml"),
           "--set", f"data.gsm8k_source={GSM8K}", *[x for o in overrides for x in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    kill_tree_at(cmd, workdir, env, workdir / "checkpoints" / "grpo.resume" / "step_000002")
    assert not (workdir / "checkpoints" / "grpo").exists()
    res = _run_cli("grpo", *overrides, cwd=workdir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stderr
    assert ("grpo: FSDP2 over 2 processes, 2 blocks each a unit" in res.stderr) == (parallel == "fsdp")
    a, b = weights(ref_dir / "checkpoints" / "grpo"), weights(workdir / "checkpoints" / "grpo")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _series(ref_dir / "plots" / "grpo.csv") == _series(workdir / "plots" / "grpo.csv")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes(dirs: tuple[Path, Path], *overrides: str) -> list[subprocess.CompletedProcess]:
    """The stage on two "machines" at once: one launcher per folder, `--nnodes 2`, meeting on 127.0.0.1."""
    port = _free_port()
    procs = [_run_cli("grpo", *overrides, cwd=d, wait=False,
                      args=("--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port",
                            str(port))) for r, d in enumerate(dirs)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, o) for p, o in zip(procs, out)]


@pytest.mark.slow
def test_two_machines_train_as_two_processes_on_one_and_refuse_unequal_resume_states(workdir, tmp_path):
    """`--nnodes 2`: two launchers, each in its own copy of the workspace (one process each), meet on
    node 0's address and train as one 2-process run on one machine does, bit for bit; node 0's copy gets
    the outputs. Re-run where only node 0's copy holds a resume state: every rank stops with one line
    naming the folder, before training (a rank that started afresh would train other weights)."""
    overrides = ("grpo.nproc=2", "grpo.iterations=4", "grpo.save_every=2", "grpo.eval_every=0")
    one, node0, node1 = (tmp_path / n for n in ("one", "node0", "node1"))
    for d in (one, node0, node1):
        shutil.copytree(workdir, d)
    res = _run_cli("grpo", *overrides, cwd=one)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _two_nodes((node0, node1), *overrides)
    assert a.returncode == 0 and b.returncode == 0, (a.stdout[-3000:], b.stdout[-3000:])
    ref, got = weights(one / "checkpoints" / "grpo"), weights(node0 / "checkpoints" / "grpo")
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert not (node1 / "checkpoints" / "grpo").exists()

    more = (*overrides[:1], "grpo.iterations=6", *overrides[2:])
    cmd = [sys.executable, "-m", "pipeline", "grpo", "--params", str(ROOT / "configs" / "smoke.yaml"),
           "--set", f"data.gsm8k_source={GSM8K}", *[x for o in more for x in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    shutil.rmtree(node0 / "checkpoints" / "grpo")
    kill_tree_at(cmd, node0, env, node0 / "checkpoints" / "grpo.resume" / "step_000002")
    a, b = _two_nodes((node0, node1), *more)
    for proc in (a, b):  # each rank: the one line (exit 2), so each launcher: torchrun failed
        assert proc.returncode != 0, proc.stdout[-3000:]
        assert "the ranks found different resume states (steps -1 to 2; -1: none)" in proc.stdout, proc.stdout[-3000:]
    assert not (node0 / "checkpoints" / "grpo").exists()


def _series(path: Path) -> list[dict[str, str]]:
    """The CSV rows without the wall-clock column, which differs between any two runs."""
    import csv

    with path.open() as f:
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "model"), [("ddp", "gpt"), ("fsdp", "gpt"), ("fsdp", "llama")])
@pytest.mark.parametrize("minibatch_groups", [0, 2])
def test_update_under_two_processes_equals_single_process(tmp_path, minibatch_groups, parallel, model, hf_dirs):
    """2-process gloo DDP (or FSDP2: weights, gradients and AdamW's moments sharded; on the GPT and on a
    transformers Llama, whose blocks FSDP finds by its _no_split_modules) on two halves of a batch == 1
    process on the whole batch (same update); with minibatch_groups 2 of 4 groups, both take two
    optimizer steps of two groups each (it once meant 2 groups per rank: one step over all 4 under DDP)."""
    script = ROOT / "tests" / "ddp_update_check.py"
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    mb, folder = str(minibatch_groups), "" if model == "gpt" else hf_dirs[model]
    single = subprocess.run([sys.executable, str(script), str(out / "single.safetensors"), mb, "ddp", folder],
                            env=env, capture_output=True, text=True, check=False, timeout=300)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(out / "ddp.safetensors"), mb, parallel, folder], env=env,
                         capture_output=True, text=True, check=False, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    a, b = load_file(str(out / "single.safetensors")), load_file(str(out / "ddp.safetensors"))
    # Adam's first step is ~lr * sign(grad): a gradient within fp noise of 0 can move a weight by up
    # to lr (1e-2). Every weight within 0.2% of lr, far below any real difference in the update, but
    # for at most one in a thousand of a tensor's weights (such near-zero gradients: on an AMD AVX512
    # CPU one of 4,096 landed 0.216% of lr apart), which still stay within lr. A wrong update (a
    # gradient not averaged, a step missing) moves most weights, not one in a thousand.
    for k in a:
        diff = (a[k] - b[k]).abs()
        loose = diff > 2e-5 + 1e-5 * b[k].abs()
        assert int(loose.sum()) <= a[k].numel() // 1000, (k, int(loose.sum()), float(diff.max()))
        assert float(diff.max()) <= 1e-2, k
    ma = json.loads((out / "single.json").read_text())
    mb = json.loads((out / "ddp.json").read_text())
    for k in ("loss", "grad_norm"):  # token-weighted exactly; per-token means (kl, clipfrac) average per rank
        assert mb[k] == pytest.approx(ma[k], rel=1e-4, abs=1e-6), k


def _csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def test_dynamic_sampling_drops_zero_variance_groups(workdir, monkeypatch):
    """Groups whose gold is odd always score 0 (no variance): DAPO dynamic sampling replaces them."""
    verifier = reward_of(lambda text, gold: float(len(text) % 2) if int(gold) % 2 == 0 else 0.0)

    cfg = smoke_cfg("warmup.iterations=2", "warmup.dynamic_sampling=true", "warmup.max_sampling_rounds=8",
                    "warmup.prompts_per_iter=4", "warmup.eval_every=0")
    run_warmup(cfg, rewards=verifier)
    rows = _csv_rows(workdir / "plots" / "warmup.csv")
    assert sum(int(r["dropped_groups"]) for r in rows) > 0
    informative_dynamic = sum(float(r["informative"]) for r in rows) / len(rows)
    for r in rows:  # the *_sampled columns count every group rolled out, the dropped (zero-variance) ones too
        kept, dropped = 4, int(r["dropped_groups"])
        assert float(r["informative_sampled"]) == pytest.approx(float(r["informative"]) * kept / (kept + dropped),
                                                                rel=1e-5)  # the CSV keeps 6 significant digits
        assert 0.0 <= float(r["reward_sampled"]) <= 1.0

    # without it, the same rewards leave the odd-gold groups (about half) in the batch
    run_warmup(dataclasses.replace(cfg, warmup=dataclasses.replace(cfg.warmup, dynamic_sampling=False)),
               rewards=verifier)
    rows = _csv_rows(workdir / "plots" / "warmup.csv")
    assert all(r["dropped_groups"] == "0" for r in rows)
    for r in rows:  # nothing dropped: the sampled batch is the trained batch
        assert float(r["reward_sampled"]) == pytest.approx(float(r["reward"]))
        assert float(r["informative_sampled"]) == pytest.approx(float(r["informative"]))
    informative_static = sum(float(r["informative"]) for r in rows) / len(rows)
    assert informative_dynamic >= 0.75 and informative_dynamic > informative_static


@pytest.mark.slow
def test_samples_go_to_one_mlflow_table_per_stage(workdir):
    """Per-iteration sample completions append to samples/<stage>.json (an `iteration` column), not
    one table per iteration: MLflow's table-name tag holds about 145 names, after which every
    log_table call of the run failed (seen at iteration 145 of the default warmup)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    run_warmup(smoke_cfg("warmup.iterations=3", "warmup.eval_every=0", "tracking.enabled=true",
                         f"tracking.uri={uri}", "tracking.experiment=samples"))
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("samples")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("grpo.stage") == "warmup"]
    assert [f.path for f in client.list_artifacts(run.info.run_id, "samples")] == ["samples/warmup.json"]
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/warmup.json", str(workdir))).read_text())
    iterations = [row[table["columns"].index("iteration")] for row in table["data"]]
    assert iterations == sorted(iterations) and set(iterations) == {1, 2, 3}
    assert "reward_sampled" in {m.split("/")[-1] for m in run.data.metrics}


def test_adaptive_curriculum_leaves_early_and_logs_why(workdir):
    cfg = smoke_cfg("warmup.iterations=6", "warmup.adaptive=true", "warmup.exit_reward=0", "warmup.exit_accuracy=0",
                    "warmup.eval_every=2")
    summary = run_warmup(cfg)
    assert summary["iterations"] == 2
    assert "leaving the warmup early" in summary["adaptive"][0]


@pytest.mark.slow
@pytest.mark.parametrize("dynamic,levels", [("false", "uniform"), ("true", "uniform"), ("true", "informative")])
def test_nproc_2_relaunches_under_torchrun_and_rank0_saves(workdir, dynamic, levels):
    """grpo.nproc=2 on CPU: the stage runs itself under torchrun (gloo); rank 0 writes the outputs.
    With dynamic sampling the ranks top up in lockstep rounds (a collective per round): no hang; with
    the draw by level, too (the level counts are summed across ranks every iteration)."""
    res = _run_cli("warmup", "warmup.nproc=2", "warmup.iterations=2", "warmup.eval_every=0",
                   f"warmup.dynamic_sampling={dynamic}", "warmup.max_sampling_rounds=3",
                   f"warmup.level_sampling={levels}", cwd=workdir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (workdir / "checkpoints" / "warmup" / "model.safetensors").is_file()
    rows = _csv_rows(workdir / "plots" / "warmup.csv")
    assert [r["iteration"] for r in rows] == ["1", "2"]
    assert not (workdir / "checkpoints" / "warmup.resume").exists()


# --------------------------------------------------------------------------- prompt sampling under DDP

@settings(max_examples=150, deadline=None)
@given(n=st.integers(5, 40), world=st.integers(1, 4), seed=st.integers(0, 1000),
       rounds=st.lists(st.lists(st.integers(0, 6), min_size=4, max_size=4), min_size=1, max_size=6))
def test_ranks_draw_in_step_and_never_share_a_prompt(n, world, seed, rounds):
    """Dynamic sampling: ranks top up different numbers of groups per round. Each rank's cursor
    must stay at the same position as the others' (else later iterations overlap) and no two ranks
    may get the same prompt in a round (within one epoch of the permutation)."""
    from pipeline.rl.group_sampling import next_prompts, next_shard

    cursors = [(0, 0)] * world
    plain = (0, 0)
    for needs in rounds:
        needs = needs[:world]
        need_max = max(needs)
        before = cursors[0][1] % n  # where this round's draw starts in the permutation
        drawn = [next_shard(n, seed, cursors[r], needs[r], need_max, r, world) for r in range(world)]
        shards, cursors = [d[0] for d in drawn], [d[1] for d in drawn]
        assert [len(x) for x in shards] == needs
        assert len({e * n + p for e, p in cursors}) == 1  # in step
        if before + need_max * world <= n:  # the round stays inside one permutation: all distinct
            flat = [i for x in shards for i in x]
            assert len(flat) == len(set(flat))
        if world == 1:
            expected, plain = next_prompts(n, seed, plain, needs[0])
            assert shards[0] == expected  # one process: exactly the plain draw


def test_fsdp_is_refused_with_lora_or_compile_naming_the_key():
    """`<stage>.parallel = fsdp` covers eager full fine-tuning (what its two-process tests run); LoRA and
    torch.compile under it are refused in one line naming the key, and plain fsdp loads."""
    from pipeline.core.config_loading import ConfigError

    with pytest.raises(ConfigError, match=r"smoke.yaml: grpo.parallel = 'fsdp' is out of range; allowed: ddp "
                                          r"while model.lora_rank > 0"):
        smoke_cfg("grpo.parallel=fsdp", "model.backend=hf", "model.init=x", "model.lora_rank=8")
    with pytest.raises(ConfigError, match=r"warmup.parallel = 'fsdp' is out of range; allowed: ddp while model.compile"):
        smoke_cfg("warmup.parallel=fsdp", "model.compile=true")
    with pytest.raises(ConfigError, match=r"grpo.parallel"):
        smoke_cfg("grpo.parallel=zero3")
    assert smoke_cfg("grpo.parallel=fsdp", "warmup.parallel=fsdp").grpo.parallel == "fsdp"


@pytest.mark.slow
def test_bad_node_flags_are_one_line_each(workdir):
    """A node rank outside [0, nnodes) and an nproc that the node count does not divide: one line naming
    the flag or key and what is allowed, exit 2, before any process starts."""
    res = _run_cli("grpo", "grpo.nproc=2", cwd=workdir, args=("--nnodes", "2", "--node-rank", "2"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == ("error: --nnodes 2 --node-rank 2: allowed: nnodes >= 1 and a node "
                                                   "rank in [0, nnodes - 1]")
    res = _run_cli("grpo", "grpo.nproc=3", "grpo.prompts_per_iter=3", cwd=workdir, args=("--nnodes", "2"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "error: grpo.nproc = 3 over --nnodes 2: allowed: a multiple of the node count (nproc counts the processes "
        "of every node, the same number on each)")
    assert not (workdir / "checkpoints" / "grpo").exists()
    before = sorted(str(p) for p in workdir.rglob("*"))
    res = _run_cli("all", cwd=workdir, args=("--nnodes", "0"))  # `all` checks them too, before any stage
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: --nnodes 0 --node-rank 0:")
    assert sorted(str(p) for p in workdir.rglob("*")) == before  # nothing written
