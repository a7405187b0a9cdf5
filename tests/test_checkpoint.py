"""Checkpoints: bit-exact round trips (both backends), refusal of damaged folders, atomic writes,
pickle-free resumable training state."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.core.errors import CheckpointError
from pipeline.model.policy import Policy, build_policy
from pipeline.train import checkpoint as ckpt
from pipeline.train import manifest as checkpoint_manifest
from pipeline.train.checkpoint import init_policy, load_extra_state, load_policy, save_policy
from pipeline.train.state import capture_rng_state, load_training_state, restore_rng_state, save_training_state
from tests.conftest import tiny_model_config


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_is_bit_exact(any_policy, tmp_path):
    folder = save_policy(tmp_path / "ckpt", any_policy, extra_state={"iteration": 3, "metric": 0.5})
    loaded = load_policy(folder, device="cpu")
    assert loaded.backend == any_policy.backend and same_weights(loaded, any_policy)
    assert loaded.tokenizer.encode("What is 7 + 8?") == any_policy.tokenizer.encode("What is 7 + 8?")
    ids = torch.tensor([any_policy.tokenizer.encode("Question: What is 7 + 8?")])
    with torch.no_grad():
        assert torch.equal(loaded.logits(ids, torch.ones_like(ids)), any_policy.eval().logits(ids, torch.ones_like(ids)))
    assert load_extra_state(folder) == {"iteration": 3, "metric": 0.5}


def test_gpt_checkpoint_layout(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "sft", gpt_policy)
    names = {p.name for p in folder.iterdir()}
    assert names == {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"}
    meta = json.loads((folder / "config.json").read_text())
    assert meta["format"] == "grpo-pipeline/gpt" and meta["gpt"]["n_layer"] == 2
    assert not list(tmp_path.glob(".*"))  # no temp folder left behind


def test_truncated_weights_are_refused_naming_the_file(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "c", gpt_policy)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_policy(folder, device="cpu")


def test_truncated_weights_refused_by_safetensors_too(gpt_policy, tmp_path):
    """Even with the manifest rewritten to match, a short safetensors file is refused."""
    folder = save_policy(tmp_path / "c", gpt_policy)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    checkpoint_manifest._write_manifest(folder)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_policy(folder, device="cpu")


def test_corrupt_byte_is_refused(any_policy, tmp_path):
    folder = save_policy(tmp_path / "c", any_policy)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupt"):
        load_policy(folder, device="cpu")


def test_mismatched_config_is_refused(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "c", gpt_policy)
    meta = json.loads((folder / "config.json").read_text())
    meta["gpt"]["n_embd"] = 64
    (folder / "config.json").write_text(json.dumps(meta))
    checkpoint_manifest._write_manifest(folder)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*do not match"):
        load_policy(folder, device="cpu")


@pytest.mark.parametrize("key,value,says", [("n_layer", 0, "model.n_layer"), ("dtype", "fp8", "model.dtype"),
                                            ("lora_rank", "4", "model.lora_rank")])
def test_a_saved_model_config_out_of_range_is_one_line_naming_the_file_and_key(gpt_policy, tmp_path, key, value, says):
    """A checkpoint whose saved `model` section holds a value the schema does not allow (edited, or
    written by a version with other ranges): a CheckpointError naming config.json and the key, not
    pydantic's multi-line ValidationError."""
    folder = save_policy(tmp_path / "c", gpt_policy)
    meta = json.loads((folder / "config.json").read_text())
    meta["model"][key] = value
    (folder / "config.json").write_text(json.dumps(meta))
    checkpoint_manifest._write_manifest(folder)
    with pytest.raises(CheckpointError) as info:
        load_policy(folder, device="cpu")
    text = str(info.value)
    assert text.startswith(str(folder / "config.json")) and says in text and "\n" not in text


def test_missing_manifest_or_folder_is_refused(gpt_policy, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_policy(tmp_path / "nope")
    folder = save_policy(tmp_path / "c", gpt_policy)
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_policy(folder)


def test_crash_while_saving_keeps_the_previous_checkpoint(gpt_policy, tmp_path, monkeypatch):
    folder = save_policy(tmp_path / "c", gpt_policy, extra_state={"v": 1})

    def crash(_folder):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt, "_write_manifest", crash)
    with torch.no_grad():
        next(gpt_policy.module.parameters()).add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_policy(folder, gpt_policy, extra_state={"v": 2})
    monkeypatch.undo()
    assert load_extra_state(folder) == {"v": 1}
    assert not same_weights(load_policy(folder, device="cpu"), gpt_policy)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # temp folder cleaned up
    save_policy(folder, gpt_policy, extra_state={"v": 2})  # a later save replaces it
    assert load_extra_state(folder) == {"v": 2} and same_weights(load_policy(folder, device="cpu"), gpt_policy)


def test_init_policy_loads_a_checkpoint_or_builds(gpt_policy, tiny_tokenizer, tmp_path):
    folder = save_policy(tmp_path / "sft", gpt_policy)
    loaded = init_policy(tiny_model_config(init=str(folder)), tiny_tokenizer)
    assert same_weights(loaded, gpt_policy)
    fresh = init_policy(tiny_model_config(), tiny_tokenizer)
    assert fresh.num_params() == gpt_policy.num_params()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        init_policy(tiny_model_config(init=str(tmp_path)), tiny_tokenizer)


# ----------------------------------------------------------------------- training state

def train_steps(policy, opt, n: int) -> list[float]:
    """A few AdamW steps on random batches drawn from the global torch RNG."""
    losses = []
    for _ in range(n):
        ids = torch.randint(0, policy.tokenizer.vocab_size, (4, 12))
        logits = policy.logits(ids, torch.ones_like(ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item() + random.random() + float(np.random.rand()))
    return losses


@pytest.mark.parametrize("backend", ["gpt", "hf-llama"])
def test_resume_is_bit_exact(backend, tiny_tokenizer, hf_dirs, tmp_path):
    def fresh():
        torch.manual_seed(0)
        cfg = tiny_model_config() if backend == "gpt" else tiny_model_config(backend="hf", init=hf_dirs["llama"])
        p = build_policy(cfg, tiny_tokenizer).train()
        return p, torch.optim.AdamW(p.parameters(), lr=1e-2, betas=(0.9, 0.95))

    policy, opt = fresh()
    random.seed(1), np.random.seed(1)
    train_steps(policy, opt, 2)
    save_training_state(tmp_path / "resume", policy, opt, {"step": 2, "lr": 1e-2}, capture_rng_state(),
                        {"iteration": 2, "history": [0.5, 0.25], "by_level": {1: 0.3}})
    expected = train_steps(policy, opt, 2)

    policy2, opt2 = fresh()
    state = load_training_state(tmp_path / "resume", policy2, opt2)
    restore_rng_state(state["rng_state"])
    assert state["scheduler_state"] == {"step": 2, "lr": 1e-2}
    assert state["extra"] == {"iteration": 2, "history": [0.5, 0.25], "by_level": {1: 0.3}}
    assert train_steps(policy2, opt2, 2) == expected
    assert same_weights(policy2, policy)
    assert {p.suffix for p in (tmp_path / "resume").iterdir()} <= {".json", ".safetensors", ".jinja"}


def test_rng_state_survives_json_round_trip(tmp_path, gpt_policy):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    save_training_state(tmp_path / "r", gpt_policy, None, None, capture_rng_state(), None)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    state = load_training_state(tmp_path / "r", gpt_policy)
    restore_rng_state(state["rng_state"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_truncated_training_state_is_refused(gpt_policy, tmp_path):
    opt = torch.optim.AdamW(gpt_policy.parameters())
    train_steps(gpt_policy, opt, 1)
    folder = save_training_state(tmp_path / "r", gpt_policy, opt, {}, {}, {})
    path = Path(folder) / "training_state.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="training_state.safetensors"):
        load_training_state(folder, gpt_policy, opt)


def test_unstorable_state_is_a_clear_type_error(gpt_policy, tmp_path):
    with pytest.raises(TypeError, match="cannot store a set"):
        save_training_state(tmp_path / "r", gpt_policy, None, None, None, {"bad": {1, 2}})
    assert not (tmp_path / "r").exists()


def test_export_rope_gpt_to_transformers_llama(gpt_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():  # non-trivial norm weights, so a swapped mapping would show
        for p in gpt_policy.module.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    folder = ckpt.export_hf(tmp_path / "hf", gpt_policy)
    llama = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = torch.tensor([[7, 8, 9, 10, 11, 12], [0, 0, 13, 14, 15, 16]]), torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        ours = gpt_policy.eval().logits(ids, mask)
        theirs = llama(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0) * mask).logits
    torch.testing.assert_close(theirs[mask.bool()], ours[mask.bool()], atol=1e-4, rtol=0)
    loaded = load_policy(folder, device="cpu")  # a plain HF folder loads as an hf policy
    assert loaded.backend == "hf" and loaded.tokenizer.encode("1 + 2") == gpt_policy.tokenizer.encode("1 + 2")
    assert loaded.tokenizer.token_id("</answer>") in loaded.stop_ids


def test_learned_positions_do_not_export(tiny_tokenizer, tmp_path):
    policy = build_policy(tiny_model_config(positions="learned"), tiny_tokenizer)
    with pytest.raises(ValueError, match="rope"):
        ckpt.export_hf(tmp_path / "hf", policy)


def test_a_checkpoint_write_removes_the_temporary_folder_of_a_killed_run(gpt_policy, tmp_path):
    """A run killed while it wrote a checkpoint leaves `.NAME.tmp-PID-*`; the next write of that
    checkpoint removes it once PID is gone, and leaves a live process's alone."""
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ck.tmp-{dead.stdout.strip()}-abcdef12"
    live = tmp_path / f".ck.tmp-{os.getppid()}-abcdef12"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    save_policy(tmp_path / "ck", gpt_policy)
    assert not stale.exists() and live.exists()
    load_policy(tmp_path / "ck")


# ----------------------------------------------------------------------- run-time keys of a stage's start

def _grpo_inputs(folder: Path, init: Policy) -> None:
    """data/gsm8k_{train,val}.jsonl and checkpoints/{sft,warmup} (= `init`) under `folder`, for the grpo stage."""
    rows = [{"id": f"g{i}", "source": "gsm8k", "question": f"What is {i} + 2?", "gold": float(i + 2),
             "prompt": f"Question: {i} + 2?\nAnswer:", "solution": f"<answer>{i + 2}</answer>", "level": 0}
            for i in range(4)]
    (folder / "data").mkdir()
    for name in ("gsm8k_train", "gsm8k_val"):
        (folder / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for stage in ("sft", "warmup"):
        save_policy(folder / "checkpoints" / stage, init)


@pytest.mark.parametrize("saved_recompute", [False, True])
@pytest.mark.slow
def test_a_stage_takes_run_time_keys_from_its_run_and_the_architecture_from_its_checkpoint(
        saved_recompute, hf_dirs, tmp_path, monkeypatch):
    """`python -m pipeline grpo --set model.compile=true` (and gradient_checkpointing, param_dtype, dtype) is
    in effect for a stage that starts from a checkpoint saved with other values; the reference follows
    the run's weight dtype too."""
    from pipeline.core.config_loading import config_from_dict
    from pipeline.stages.grpo import setup

    monkeypatch.chdir(tmp_path)
    _grpo_inputs(tmp_path, build_policy(tiny_model_config(backend="hf", init=hf_dirs["llama"],
                                                          gradient_checkpointing=saved_recompute)))
    run_keys = dict(compile=True, gradient_checkpointing=not saved_recompute, param_dtype="bfloat16", dtype="bfloat16")
    model = tiny_model_config(backend="hf", init=hf_dirs["llama"], **run_keys)
    cfg = config_from_dict({"model": dataclasses.asdict(model), "sft": {"max_len": 64}, "warmup": {"rollout_len": 8},
                            "grpo": {"prompts_per_iter": 2, "group_size": 2, "rollout_len": 6, "kl_coef": 0.1},
                            "tracking": {"enabled": False}})
    run = setup(cfg, "grpo")
    policy = run.policy
    assert getattr(policy.runner, "_orig_mod", None) is policy.module  # compiled (lazily: nothing runs here)
    assert policy.recompute is not saved_recompute
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16} == {p.dtype for p in run.ref.parameters()}
    assert policy.autocast_dtype == torch.bfloat16
    assert {k: getattr(policy.model_cfg, k) for k in run_keys} == run_keys


@pytest.mark.slow
def test_load_policy_takes_the_runs_run_time_keys(gpt_policy, tmp_path):
    """A gpt checkpoint loaded for a run: the architecture is the checkpoint's, dropout and the rest the run's."""
    folder = save_policy(tmp_path / "sft", gpt_policy)
    run = tiny_model_config(n_layer=3, dropout=0.25, compile=True, dtype="bfloat16")
    loaded = load_policy(folder, device="cpu", run=run)
    assert loaded.module.config.n_layer == gpt_policy.module.config.n_layer == loaded.model_cfg.n_layer == 2
    assert loaded.module.config.dropout == loaded.model_cfg.dropout == 0.25
    assert loaded.model_cfg.compile and getattr(loaded.runner, "_orig_mod", None) is loaded.module
    assert loaded.autocast_dtype == torch.bfloat16 and same_weights(loaded, gpt_policy)
    with pytest.raises(CheckpointError, match=r"^model.backend = 'hf' in this run's config, but .* holds a 'gpt' model"):
        load_policy(folder, device="cpu", run=tiny_model_config(backend="hf", gradient_checkpointing=True))
    # every key is one or the other (`init` is where the checkpoint came from)
    assert set(ckpt.ARCH_FIELDS) | set(ckpt.RUNTIME_FIELDS) | {"init"} == {f.name for f in dataclasses.fields(run)}


def test_hf_weights_as_a_pickle_are_refused_in_one_line_and_never_unpickled(hf_dirs, tmp_path, monkeypatch):
    """A model folder whose weights are `pytorch_model.bin` (a pickle): one InputError naming the file and
    how to convert it, before transformers (whose own message advises `weights_only=False`) or torch
    ever opens it; the same folder with safetensors loads."""
    import shutil

    import torch

    from pipeline.core.errors import InputError
    from pipeline.model.hf import load_hf

    folder = tmp_path / "m"
    shutil.copytree(hf_dirs["llama"], folder)
    weights = next(folder.glob("*.safetensors"))
    from safetensors.torch import load_file

    torch.save(load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was opened"))
    with pytest.raises(InputError) as info:
        load_hf(folder)
    text = str(info.value)
    assert text.startswith(f"{folder}: no safetensors weights; pytorch_model.bin is a pickle file") and "\n" not in text
    assert "save_pretrained" in text
    model, _ = load_hf(hf_dirs["llama"])  # the safetensors original
    assert sum(p.numel() for p in model.parameters()) > 0
