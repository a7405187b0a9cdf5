"""Checkpoint folders on disk: atomic writes, the manifest and its verification, size checks.

Every checkpoint folder (:mod:`pipeline.train.checkpoint`, :mod:`pipeline.train.state`) ends with
``manifest.json``: byte size and SHA-256 of every other file.

Untrusted folders: every folder with a manifest is verified against it before anything in it is
read (files it does not list are refused too), and no model is built before its parameter count,
computed from its config alone, is checked against :func:`max_params` (MAX_PARAMS, or half the
memory available). A disk-full or file-size-limit error while writing is a one-line
:class:`~pipeline.core.errors.StorageError`; the previous checkpoint stays intact.

Atomicity: everything is written into a hidden sibling temp folder, fsynced, then renamed into
place. A crash leaves either the previous checkpoint or the new one; a crash between the two
renames of a replacement leaves the old one at ``.NAME.old-*`` and no half-written ``NAME``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from pipeline.core.errors import CheckpointError
from pipeline.core.files import ensure_dir, raise_if_storage, real_target, remove_stale, sha256, storage_errors
from pipeline.model.gpt import GPTConfig


WEIGHTS = "model.safetensors"
CONFIG = "config.json"
HF_META = "pipeline.json"
STATE = "state.json"
MANIFEST = "manifest.json"
TRAIN_JSON = "training_state.json"
TRAIN_TENSORS = "training_state.safetensors"
ADAPTER = "adapter.safetensors"  # LoRA adapter tensors of a resumable training state
FORMAT_GPT = "grpo-pipeline/gpt"
FORMAT_HF = "grpo-pipeline/hf"
TIED_KEYS = ("lm_head.weight",)  # aliases of wte.weight in the GPT; stored once
MAX_PARAMS = 3_000_000_000  # the largest model a loader builds (fp32: 12 GB); see max_params()
MAX_JSON_BYTES = 1 << 24


# --------------------------------------------------------------------------- atomic folders

@contextlib.contextmanager
def _atomic_folder(folder: str | Path):
    """Yield a temp folder; on success it replaces `folder` (rename), on error it is removed. A
    `folder` that is a symlink stays one: the folder it points to is replaced (files.real_target)."""
    folder = real_target(folder)
    ensure_dir(folder.parent)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: is a file where a checkpoint folder is written; move it away")
    remove_stale(folder.parent, f".{folder.name}.tmp-")  # left by a run killed while it wrote this folder
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder.parent / f".{folder.name}.tmp-{tag}"
    with storage_errors(folder):
        tmp.mkdir()
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{tag}"
            os.rename(folder, old)
            os.rename(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, folder)
        with contextlib.suppress(OSError):  # make the renames durable
            fd = os.open(folder.parent, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    except Exception as exc:  # safetensors reports a full disk as SafetensorError("... (os error 28)")
        shutil.rmtree(tmp, ignore_errors=True)
        raise_if_storage(exc, folder)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify(folder: str | Path) -> None:
    """Check the manifest against the folder: every listed file present, full size, same SHA-256,
    and no file the manifest does not list (a config.json dropped in later is refused too)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{manifest}: missing; {folder} is not a complete checkpoint")
    doc = _read_json(manifest)
    entries = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise CheckpointError(f"{manifest}: malformed (no 'files' mapping)")
    for name, meta in entries.items():
        _verify_entry(folder, manifest, name, meta)
    listed = {str(Path(n)) for n in entries}
    extra = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.name != MANIFEST and str(p.relative_to(folder)) not in listed)
    if extra:
        raise CheckpointError(f"{folder / extra[0]}: not in the checkpoint's manifest (added after it was "
                              "written?); remove it or re-run the stage that writes this checkpoint")


def _verify_entry(folder: Path, manifest: Path, name: Any, meta: Any) -> None:
    size, digest = (meta.get("bytes"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
        raise CheckpointError(f"{manifest}: entry {name!r} needs 'bytes' (an integer) and 'sha256' (hex text)")
    path = folder / str(name)
    if Path(str(name)).is_absolute() or ".." in Path(str(name)).parts:
        raise CheckpointError(f"{manifest}: entry {name!r} points outside the checkpoint folder")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    actual = path.stat().st_size
    if actual != size:
        raise CheckpointError(f"{path}: truncated or altered ({actual} bytes, expected {size})")
    if sha256(path) != digest:
        raise CheckpointError(f"{path}: corrupt (SHA-256 does not match the manifest)")


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes is too large for a checkpoint's JSON file")
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and integers of over 4,300 digits
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


# --------------------------------------------------------------------------- size before build

def max_params() -> int:
    """The largest model (parameters) any loader builds: MAX_PARAMS, or less where memory is short
    (fp32 weights must fit in half the memory available now)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return MAX_PARAMS
    return max(1, min(MAX_PARAMS, available // 2 // 4))


def check_size(params: int, where: Path, what: str) -> None:
    """CheckpointError if a model of `params` parameters may not be built (see :func:`max_params`)."""
    limit = max_params()
    if params > limit:
        raise CheckpointError(f"{where}: {what} has ~{params / 1e6:,.0f}M parameters, more than the "
                              f"{limit / 1e6:,.0f}M this machine may build; refused before building it")


def _positive(cfg: dict, *names: str, default: int | None = None) -> int | None:
    """The first of `names` present in `cfg`; ValueError unless it is a positive integer."""
    for name in names:
        if cfg.get(name) is not None:
            value = cfg[name]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} = {value!r} is not a positive integer")
            return value
    return default


def hf_param_count(folder: Path) -> int:
    """Parameters of the causal LM `folder/config.json` describes, computed from the JSON alone
    (nothing is imported, built or allocated). `save_pretrained` always writes the sizes; a config
    that omits them (`{"model_type": "llama"}` would mean a 7B default) is refused."""
    path = folder / CONFIG
    raw = _read_json(path)
    cfg = raw.get("text_config") if isinstance(raw, dict) and isinstance(raw.get("text_config"), dict) else raw
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    try:
        h = _positive(cfg, "hidden_size", "n_embd", "d_model")
        layers = _positive(cfg, "num_hidden_layers", "n_layer", "num_layers")
        vocab = _positive(cfg, "vocab_size")
        if h is None or layers is None or vocab is None:
            raise ValueError("it does not state hidden_size, num_hidden_layers and vocab_size")
        heads = _positive(cfg, "num_attention_heads", "n_head", default=1)
        kv = _positive(cfg, "num_key_value_heads", default=heads)
        head_dim = _positive(cfg, "head_dim", default=max(1, h // heads))
        inner = _positive(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
        experts = _positive(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=1)
    except ValueError as exc:
        raise CheckpointError(f"{path}: cannot tell the model's size ({exc}); refused rather than built blind") from None
    attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    mlp = 3 * h * inner * experts  # gated MLPs have three matrices: an upper bound for two
    tied = cfg.get("tie_word_embeddings") is True
    positions = h * (_positive(cfg, "n_positions", default=0) or 0)  # a learned table (GPT-2 style)
    extras = 4 * h + 2 * inner  # biases and norms, generously
    return vocab * h * (1 if tied else 2) + positions + layers * (attn + mlp + extras)


def gpt_param_count(cfg: GPTConfig) -> int:
    """Parameters of the pipeline's GPT for `cfg` (tied head counted once), without building it."""
    h = cfg.n_embd
    learned = cfg.block_size * h if cfg.positions == "learned" else 0
    return cfg.vocab_size * h + learned + cfg.n_layer * (16 * h * h + 2 * h) + h  # attn 4h², SwiGLU 12h²


def _check_weight_files(folder: Path) -> None:
    """Weights larger on disk than the largest model allowed are refused before they are read."""
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors") if p.is_file())
    if size > 4 * max_params():
        raise CheckpointError(f"{folder}: {size / 1e9:.1f} GB of weights is more than this machine may load")


def is_checkpoint(folder: str | Path) -> bool:
    """True if `folder` holds a checkpoint written by this module."""
    return (Path(folder) / MANIFEST).is_file()
