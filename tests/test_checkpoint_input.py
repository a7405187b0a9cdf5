"""Checkpoints a hostile user or a broken disk hands the loader: verified whatever the backend,
sized before anything is built, one line on a full disk with the previous checkpoint intact."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import CheckpointError, StorageError
from pipeline.train import manifest as checkpoint_manifest
from pipeline.train.checkpoint import load_policy, save_policy

REPO = Path(__file__).resolve().parents[1]
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000,
            "intermediate_size": 11008, "num_attention_heads": 32}


def test_a_foreign_config_in_a_pipeline_checkpoint_is_refused_by_the_manifest(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "warmup", gpt_policy)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match=r"config.json: truncated or altered"):
        load_policy(folder, device="cpu")


def test_an_hf_checkpoint_is_verified_too(any_policy, tmp_path):
    folder = save_policy(tmp_path / "c", any_policy)
    (folder / "notes.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"notes.bin: not in the checkpoint's manifest"):
        load_policy(folder, device="cpu")


@pytest.mark.parametrize("config,pattern", [
    ({"model_type": "llama"}, r"cannot tell the model's size \(it does not state hidden_size"),
    (LLAMA_7B, r"the model it describes has ~\d[\d,]*M parameters, more than"),
    ({**LLAMA_7B, "hidden_size": -1}, r"hidden_size = -1 is not a positive integer"),
    ({**LLAMA_7B, "vocab_size": "many"}, r"vocab_size = 'many' is not a positive integer"),
    ({"model_type": "mixtral", "hidden_size": 1024, "num_hidden_layers": 24, "vocab_size": 32000,
      "intermediate_size": 14336, "num_local_experts": 8}, r"more than"),
    # json refuses an integer of over 4,300 digits with a plain ValueError (once a traceback)
    ('{"hidden_size": ' + "9" * 5000 + "}", r"config\.json: not valid JSON \(Exceeds the limit"),
    (b'{"model_type": "\xff"}', r"config\.json: not valid JSON \('utf-8' codec can't decode"),
])
def test_a_plain_hf_folder_is_sized_before_it_is_built(tmp_path, config, pattern):
    folder = tmp_path / "foreign"
    folder.mkdir()
    if isinstance(config, bytes):
        (folder / "config.json").write_bytes(config)
    else:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_policy(folder, device="cpu")
    assert "\n" not in str(info.value)


def test_the_size_estimate_matches_real_models(hf_dirs, gpt_policy):
    import torch

    from pipeline.model.hf import load_hf

    for folder in hf_dirs.values():
        module, _ = load_hf(folder)
        real = sum(p.numel() for p in module.parameters())
        estimate = checkpoint_manifest.hf_param_count(Path(folder))
        assert real <= estimate <= 1.6 * real + 10_000  # an upper bound, not far off
    real = sum(p.numel() for p in gpt_policy.module.parameters())
    assert checkpoint_manifest.gpt_param_count(gpt_policy.module.config) == pytest.approx(real, rel=0.02)
    del torch


def test_an_oversized_gpt_config_with_a_forged_manifest_is_refused(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "c", gpt_policy)
    meta = json.loads((folder / "config.json").read_text())
    meta["gpt"].update(n_embd=65536, n_layer=64)
    (folder / "config.json").write_text(json.dumps(meta))
    checkpoint_manifest._write_manifest(folder)
    with pytest.raises(CheckpointError, match=r"the GPT it describes has ~[\d,]+M parameters"):
        load_policy(folder, device="cpu")


@pytest.mark.parametrize("entry,pattern", [
    ({"sha256": "00"}, r"entry 'model.safetensors' needs 'bytes' \(an integer\) and 'sha256'"),
    ({"bytes": "12", "sha256": "00"}, r"needs 'bytes'"),
    ("not a mapping", r"needs 'bytes'"),
])
def test_a_malformed_manifest_entry_is_one_line(gpt_policy, tmp_path, entry, pattern):
    folder = save_policy(tmp_path / "c", gpt_policy)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = entry
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=pattern):
        load_policy(folder, device="cpu")


def test_a_manifest_entry_outside_the_folder_is_refused(gpt_policy, tmp_path):
    folder = save_policy(tmp_path / "c", gpt_policy)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"bytes": 1, "sha256": "00"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"points outside the checkpoint folder"):
        checkpoint_manifest.verify(folder)


def test_a_checkpoint_folder_that_is_a_file_is_one_line(gpt_policy, tmp_path):
    (tmp_path / "c").write_text("x")
    with pytest.raises(CheckpointError, match="is a file where a checkpoint folder is written"):
        save_policy(tmp_path / "c", gpt_policy)


_SAVE_UNDER_LIMIT = """
import resource, sys, torch
from pipeline.core.errors import StorageError
from pipeline.train.checkpoint import load_policy, save_policy
policy = load_policy(sys.argv[1], device="cpu")
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
try:
    save_policy(sys.argv[2], policy, extra_state={"v": 2})
except StorageError as exc:
    print(exc)
"""


@pytest.mark.slow
def test_a_file_size_limit_during_a_checkpoint_write_is_one_line_and_keeps_the_last(gpt_policy, tmp_path):
    good = save_policy(tmp_path / "good", gpt_policy, extra_state={"v": 1})
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    res = subprocess.run([sys.executable, "-c", _SAVE_UNDER_LIMIT, str(good), str(good), "20000"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("good: cannot write (File too large); the previous version, if any, "
                                       "is left intact; free space or raise the limit and re-run")
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["good"]  # no temporary folder left behind
    assert load_policy(good, device="cpu") is not None


def test_storage_errors_are_one_line_for_plain_files(tmp_path):
    from pipeline.core.files import write_json_atomic

    code = ("import resource, sys\nfrom pipeline.core.files import write_bytes_atomic\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
            f"write_bytes_atomic({str(tmp_path / 'm.json')!r}, b'x' * 5000)\n")
    write_json_atomic(tmp_path / "m.json", {"old": True})
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 1 and "StorageError" in res.stderr and "m.json: cannot write (File too large)" in res.stderr
    assert json.loads((tmp_path / "m.json").read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
    assert issubclass(StorageError, Exception)


@pytest.mark.slow
def test_cli_refuses_a_foreign_checkpoint_cheaply(tmp_path):
    """`{"model_type": "llama"}` as the warmup checkpoint once built a 7B Llama (27 GB, OOM-killed)."""
    warm = tmp_path / "checkpoints" / "warmup"
    warm.mkdir(parents=True)
    (warm / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "checkpoints" / "sft").mkdir()
    (tmp_path / "checkpoints" / "sft" / "config.json").write_text(json.dumps(LLAMA_7B))
    data = tmp_path / "data"
    data.mkdir()
    row = {"id": "a-0", "source": "arith", "question": "1+1", "prompt": "1+1=", "gold": 2.0,
           "solution": "<answer>2</answer>", "level": 1}
    for name in ("gsm8k_train", "gsm8k_val"):
        (data / f"{name}.jsonl").write_text(json.dumps({**row, "source": "gsm8k"}) + "\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-m", "pipeline", "grpo", "--params", str(REPO / "configs" / "smoke.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "cannot tell the model's size" in res.stderr or "more than" in res.stderr
    assert after.ru_maxrss < 2_000_000  # KiB: the child never went above 2 GB
    # CPU seconds: building the 7B model takes minutes; importing torch and the stage takes 3-6 s on a
    # slow shared 2-core machine (5.0 failed there with nothing built), hence 20
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 20.0
