"""The worked-example budget (`sft.arith_examples`) and the control stage: SFT continued from
checkpoints/sft for `control.steps` steps, the equal-compute baseline of the warmup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.core.config import ConfigError
from pipeline.core.errors import InputError
from pipeline.data import sft_batches
from pipeline.data.schema import read_rows
from pipeline.stages import sft

from tests.conftest import GSM8K, REPO, smoke_cfg, weights


@pytest.fixture
def workdir(grpo_workdir):
    """Prepared smoke data, and as checkpoints/sft a random policy that a fresh build with the
    control's seed does not reproduce (so starting from the wrong weights shows)."""
    shutil.rmtree("checkpoints/sft")
    shutil.move("checkpoints/warmup", "checkpoints/sft")
    return grpo_workdir


def arith_examples_drawn(run: sft.SFTRun, batches: int) -> set[tuple[int, ...]]:
    """Every arithmetic sequence the batch order yields in `batches` batches."""
    arith, n_arith = run.batches.parts[0]
    assert n_arith > 0
    drawn = set()
    for _ in range(batches):
        first = run.batches.next()[0]  # the arithmetic part comes first
        assert len(first) == n_arith
        drawn |= {tuple(ids) for ids, _ in first}
    return drawn


@pytest.mark.parametrize("stage", ["sft", "control"])
def test_the_budget_is_the_first_n_worked_solutions(workdir, stage):
    """With sft.arith_examples = 5, many epochs of batches show exactly the first 5 rows' sequences,
    in the SFT and in the control alike; 0 means the whole stream."""
    rows = read_rows(Path("data/arith_train.jsonl"))
    run = sft.setup(smoke_cfg("sft.arith_examples=5"), stage)
    first = {tuple(ids) for ids, _ in sft_batches.encode_examples(run.tok, rows[:5], run.conf.max_len)[0]}
    assert len(first) == 5
    assert arith_examples_drawn(run, 20) == first  # 20 batches x 4 arithmetic sequences: 16 epochs
    whole = sft.setup(smoke_cfg(), stage)
    assert len(whole.batches.parts[0][0]) == len(rows) > 5


def test_the_level_cap_keeps_only_easy_worked_solutions(workdir):
    """sft.arith_max_level = 1 leaves out every worked solution of a harder level, then
    sft.arith_examples takes the first N of what is left; the control learns from the same rows."""
    rows = read_rows(Path("data/arith_train.jsonl"))
    easy = [r for r in rows if r["level"] <= 1]
    assert 0 < len(easy) < len(rows)
    for stage in sft.SFT_STAGES:
        run = sft.setup(smoke_cfg("sft.arith_max_level=1", "sft.arith_examples=3"), stage)
        want = {tuple(ids) for ids, _ in sft_batches.encode_examples(run.tok, easy[:3], run.conf.max_len)[0]}
        assert arith_examples_drawn(run, 10) == want
    cfg = smoke_cfg("sft.arith_max_level=1")
    assert [r["id"] for r in sft_batches.worked_examples(rows, cfg.sft)] == [r["id"] for r in easy]
    # a scarce budget of hard ones: the first 2 rows above the cap join, in stream order
    hard = [r["id"] for r in rows if r["level"] > 1][:2]
    kept = sft_batches.worked_examples(rows, smoke_cfg("sft.arith_max_level=1", "sft.arith_hard_examples=2").sft)
    assert [r["id"] for r in kept] == [r["id"] for r in rows if r["level"] <= 1 or r["id"] in hard]
    assert sft_batches.worked_examples(rows, smoke_cfg("sft.arith_hard_examples=2").sft) == rows  # no cap: all
    with pytest.raises(ConfigError, match=r"sft.arith_max_level.*\[0, data.arith_max_level\]"):
        smoke_cfg(f"sft.arith_max_level={cfg.data.arith_max_level + 1}")


def test_the_budget_is_checked_and_keys_the_resume_state(workdir):
    keys = {sft.compatibility_key(smoke_cfg(*o), stage) for o in ((), ("sft.arith_examples=5",))
            for stage in sft.SFT_STAGES}
    assert len(keys) == 4  # a resume state of another budget, or of the other stage, is never picked up
    with pytest.raises(ConfigError, match="sft.arith_examples.*an integer >= 0"):
        smoke_cfg("sft.arith_examples=-1")
    with pytest.raises(ConfigError, match="evaluate.stages.*sft, control, warmup, grpo"):
        smoke_cfg("evaluate.stages=[sft, controls]")


def test_control_starts_from_the_sft_weights_and_trains_on(workdir):
    """control.steps = 0 saves checkpoints/sft's weights unchanged; control.steps = 4 moves them,
    with the control's own schedule, and writes its own checkpoint and series."""
    from pipeline.train.checkpoint import load_extra_state

    start = weights(Path("checkpoints/sft"))
    out = sft.run_sft(smoke_cfg("control.steps=0"), "control")
    assert out["checkpoint"] == "checkpoints/control" and out["steps"] == 0
    saved = weights(Path("checkpoints/control"))
    assert saved.keys() == start.keys() and all(torch.equal(saved[k], start[k]) for k in start)

    out = sft.run_sft(smoke_cfg("control.steps=4", "control.eval_every=2", "sft.log_every=1"), "control")
    moved = weights(Path("checkpoints/control"))
    assert any(not torch.equal(moved[k], start[k]) for k in start)
    assert weights(Path("checkpoints/sft")).keys() == start.keys()  # the start is read, never written
    assert all(torch.equal(weights(Path("checkpoints/sft"))[k], start[k]) for k in start)
    header, *rows = Path("plots/control.csv").read_text().splitlines()
    assert header == ",".join(sft.CSV_COLUMNS)
    assert [r.split(",")[0] for r in rows] == ["1", "2", "3", "4"]
    assert rows[1].split(",")[3] != "" and rows[0].split(",")[3] == ""  # held-out accuracy every 2 steps
    state = load_extra_state("checkpoints/control")
    assert state["stage"] == "control" and state["step"] == 4 and out["steps"] == 4
    assert not Path("checkpoints/control.resume").exists() and not Path("plots/sft.csv").exists()


def test_control_refuses_model_params_that_disagree_with_the_sft_checkpoint(workdir):
    """The control continues checkpoints/sft: a model override cannot resize it, so it is an error
    naming both values, as for the warmup, not silently ignored."""
    with pytest.raises(InputError, match=r"model.n_layer = 3 in the params, but checkpoints/sft was written "
                                         r"with model.n_layer = 2"):
        sft.run_sft(smoke_cfg("model.n_layer=3"), "control")
    assert not Path("checkpoints/control").exists()


@pytest.mark.slow
def test_killed_control_resumes_bit_identically(workdir, monkeypatch, caplog):
    """Stopped right after its resume state at step 2 and run again, the control ends with the
    weights and series of an uninterrupted run, bit for bit (CPU); new SFT weights void the state."""
    cfg = smoke_cfg("control.steps=4", "sft.save_every=2")
    sft.run_sft(cfg, "control")
    whole, series = weights(Path("checkpoints/control")), Path("plots/control.csv").read_text()

    class Killed(Exception):
        pass

    real = sft.save_resume

    def save_then_die(folder, step, *a, **k):
        real(folder, step, *a, **k)
        raise Killed

    monkeypatch.setattr(sft, "save_resume", save_then_die)
    with pytest.raises(Killed):
        sft.run_sft(cfg, "control")
    monkeypatch.setattr(sft, "save_resume", real)
    assert [p.name for p in Path("checkpoints/control.resume").iterdir()] == ["step_000002"]
    with caplog.at_level("INFO", logger="pipeline"):
        sft.run_sft(cfg, "control")
    assert "resuming from checkpoints/control.resume/step_000002" in caplog.text
    again = weights(Path("checkpoints/control"))
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert Path("plots/control.csv").read_text() == series

    monkeypatch.setattr(sft, "save_resume", save_then_die)
    with pytest.raises(Killed):
        sft.run_sft(cfg, "control")
    monkeypatch.setattr(sft, "save_resume", real)
    shutil.rmtree("checkpoints/sft")
    shutil.copytree("checkpoints/control", "checkpoints/sft")  # other start weights: the state is stale
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        sft.run_sft(cfg, "control")
    assert "ignoring resume state" in caplog.text and "resuming from" not in caplog.text


@pytest.mark.slow
def test_missing_sft_checkpoint_is_one_line_and_exit_2(workdir):
    shutil.rmtree("checkpoints/sft")
    with pytest.raises(InputError, match=r"checkpoints/sft: checkpoint not found.*the sft stage"):
        sft.run_sft(smoke_cfg(), "control")
    cmd = [sys.executable, "-m", "pipeline", "control", "--params", str(REPO / "configs" / "smoke.yaml"),
           "--set", f"data.gsm8k_source={GSM8K}"]
    proc = subprocess.run(cmd, cwd=workdir, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoints/sft: checkpoint not found" in lines[0] and "sft stage" in lines[0]
    assert not Path("checkpoints/control").exists()


def test_control_of_an_hf_init_model_trains_with_the_models_tokenizer(grpo_workdir, hf_dirs):
    """model.init set: sft copies the HF model, the control fine-tunes that copy, encoding the data
    with the model's own tokenizer (data/tokenizer.json is the BPE of another model)."""
    from pipeline.train.checkpoint import load_policy

    cfg = smoke_cfg("model.backend=hf", f"model.init={hf_dirs['gpt2']}", "model.block_size=128", "sft.max_len=128",
                    "control.steps=2", "sft.eval_samples=2")
    sft.run_sft(cfg)
    start = weights(Path("checkpoints/sft"))
    out = sft.run_sft(cfg, "control")
    assert out["steps"] == 2 and out["dropped_long"] < 400
    policy = load_policy("checkpoints/control", "cpu")
    assert policy.backend == "hf"
    moved = weights(Path("checkpoints/control"))
    assert any(not torch.equal(moved[k], start[k]) for k in start if k in moved)
    run = sft.setup(cfg, "control")
    assert run.tok is run.policy.tokenizer and type(run.tok).__name__ == "HFTokenizer"


def test_control_with_lora_trains_adapters_like_the_warmup(grpo_workdir, hf_dirs):
    """model.lora_rank > 0: the control trains LoRA adapters on the SFT model, as the warmup does, and
    saves them merged: only the targeted weights move."""
    pytest.importorskip("peft")
    cfg = smoke_cfg("model.backend=hf", f"model.init={hf_dirs['llama']}", "model.block_size=128", "sft.max_len=128",
                    "model.lora_rank=4", "model.lora_targets=[q_proj, v_proj]", "control.steps=2",
                    "control.lr=1e-2", "sft.eval_samples=0")
    sft.run_sft(cfg)
    start = weights(Path("checkpoints/sft"))
    sft.run_sft(cfg, "control")
    moved = weights(Path("checkpoints/control"))
    assert moved.keys() == start.keys()
    changed = {k for k in start if not torch.equal(start[k], moved[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed
