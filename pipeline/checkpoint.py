"""Checkpoints: safetensors + JSON, never pickle; written atomically; verified on load.

Policy folder (``save_policy`` / ``load_policy``):

- gpt backend: ``model.safetensors`` (weights; the tied head is stored once), ``config.json``
  (``{"format": "grpo-pipeline/gpt", "model": ModelConfig, "gpt": GPTConfig}``), ``tokenizer.json``;
- hf backend: the ``save_pretrained`` files of the model and tokenizer (their own ``config.json``)
  plus ``pipeline.json`` (``{"format": "grpo-pipeline/hf", "model": ModelConfig}``);
- both: ``state.json`` (the caller's ``extra_state``, if any) and ``manifest.json``: byte size and
  SHA-256 of every other file. Loading checks it, so a truncated or corrupt file is refused with a
  :class:`~pipeline.errors.CheckpointError` naming the file.

Resumable training state (``save_training_state`` / ``load_training_state``): the policy files
above plus ``training_state.json`` (optimizer param groups, scheduler state, RNG states, extra;
tensors replaced by references) and ``training_state.safetensors`` (the referenced tensors:
AdamW moments, torch RNG bytes, ...). Tuples, non-string dict keys and numpy arrays are tagged in
the JSON so the round trip is exact.

Untrusted folders: every folder with a manifest is verified against it before anything in it is
read (files it does not list are refused too), and no model is built before its parameter count,
computed from its config alone, is checked against :func:`max_params` (MAX_PARAMS, or half the
memory available). A disk-full or file-size-limit error while writing is a one-line
:class:`~pipeline.errors.StorageError`; the previous checkpoint stays intact.

Atomicity: everything is written into a hidden sibling temp folder, fsynced, then renamed into
place. A crash leaves either the previous checkpoint or the new one; a crash between the two
renames of a replacement leaves the old one at ``.NAME.old-*`` and no half-written ``NAME``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import ModelConfig
from pipeline.errors import CheckpointError
from pipeline.files import ensure_dir, raise_if_storage, sha256, storage_errors
from pipeline.model.gpt import GPT, GPTConfig
from pipeline.model.lora import adapter_state, is_lora, load_adapter_state, merged_state_dict
from pipeline.model.policy import Policy, build_policy, param_dtype

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
    """Yield a temp folder; on success it replaces `folder` (rename), on error it is removed."""
    folder = Path(folder)
    ensure_dir(folder.parent)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: is a file where a checkpoint folder is written; move it away")
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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
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


# --------------------------------------------------------------------------- policy files

def _write_policy_files(folder: Path, policy: Policy, extra_state: dict | None) -> None:
    model_cfg = dataclasses.asdict(policy.model_cfg)
    if policy.backend == "gpt":
        from safetensors.torch import save_file

        state = {k: v.detach().cpu().contiguous() for k, v in policy.module.state_dict().items()
                 if k not in TIED_KEYS}
        save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
        meta = {"format": FORMAT_GPT, "model": model_cfg, "gpt": dataclasses.asdict(policy.module.config)}
        (folder / CONFIG).write_text(json.dumps(meta, indent=1))
        policy.tokenizer.save(folder)
    else:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if is_lora(policy.module):  # adapters merged in: a plain transformers folder, like any other
            policy.module.get_base_model().save_pretrained(folder, state_dict=merged_state_dict(policy.module))
        else:
            policy.module.save_pretrained(folder)
        policy.tokenizer.save(folder)
        (folder / HF_META).write_text(json.dumps({"format": FORMAT_HF, "model": model_cfg}, indent=1))
    if extra_state is not None:
        (folder / STATE).write_text(json.dumps(extra_state, indent=1))


def save_policy(folder: str | Path, policy: Policy, extra_state: dict | None = None) -> Path:
    """Write the policy (and `extra_state`, JSON-serialisable) to `folder`, atomically."""
    with _atomic_folder(folder) as tmp:
        _write_policy_files(tmp, policy, extra_state)
        _write_manifest(tmp)
    return Path(folder)


def _model_config(raw: Any, path: Path) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: 'model' must be a mapping of ModelConfig fields")
    return ModelConfig(**{k: v for k, v in raw.items() if k in names})


def _check_finite(tensors, path: Path) -> None:
    """CheckpointError if any floating-point tensor holds inf or nan or is beyond WEIGHT_LIMIT (a
    state saved after a blow-up: sampling from it fails, so it cannot continue)."""
    from pipeline.training import WEIGHT_LIMIT

    for t in tensors:
        if t.is_floating_point() and t.numel() and not float(t.detach().abs().amax()) <= WEIGHT_LIMIT:
            raise CheckpointError(f"{path}: holds non-finite or exploded weights (|w| > {WEIGHT_LIMIT:g}); refused")


def _load_gpt_weights(module: GPT, path: Path, device) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        # read on the host; load_state_dict copies into the module's parameters on any device
        state = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    _check_finite(state.values(), path)
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not match the model config ({exc})".replace("\n", " ")) from None
    missing = [k for k in missing if k not in TIED_KEYS]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model config "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")


def load_policy(folder: str | Path, device: str | torch.device | None = None) -> Policy:
    """Load a policy saved by :func:`save_policy` (either backend), or a plain HF model folder.

    A folder with a manifest (every checkpoint the pipeline writes) is verified against it first,
    whatever its backend; a model's size is computed from its config and checked
    (:func:`check_size`) before anything is built or read. `device` None: `auto` (CUDA if
    available), not the device of the machine that saved it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    device = device if device is not None else "auto"
    if is_checkpoint(folder):
        verify(folder)
    _check_weight_files(folder)
    if (folder / HF_META).is_file():
        return _load_hf_policy(folder, device)
    meta = _read_json(folder / CONFIG)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{folder / CONFIG}: expected a JSON object")
    if meta.get("format") != FORMAT_GPT:
        if "model_type" in meta:  # a plain HF save_pretrained folder
            return _load_hf_policy(folder, device)
        raise CheckpointError(f"{folder / CONFIG}: neither a grpo-pipeline nor a HF model config")
    if not is_checkpoint(folder):
        verify(folder)  # a pipeline config without its manifest: refused as incomplete
    return _load_gpt_policy(folder, meta, device)


def _load_gpt_policy(folder: Path, meta: dict, device) -> Policy:
    from pipeline.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder)
    except (ValueError, FileNotFoundError) as exc:
        raise CheckpointError(str(exc)) from None
    model_cfg = _model_config(meta.get("model"), folder / CONFIG)
    try:
        gpt_cfg = GPTConfig(**meta["gpt"])
        check_size(gpt_param_count(gpt_cfg), folder / CONFIG, "the GPT it describes")
        module = GPT(gpt_cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / CONFIG}: bad 'gpt' config ({exc})") from None
    if gpt_cfg.vocab_size != tokenizer.vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.json'}: vocab_size {tokenizer.vocab_size} does not match "
                              f"the model's {gpt_cfg.vocab_size}")
    policy = Policy(module, tokenizer, model_cfg, device)
    _load_gpt_weights(policy.module, folder / WEIGHTS, policy.device)
    return policy


def _load_hf_policy(folder: Path, device) -> Policy:
    from pipeline.model.hf import load_hf

    if (folder / HF_META).is_file():
        verify(folder)
        model_cfg = _model_config(_read_json(folder / HF_META).get("model"), folder / HF_META)
    else:  # a plain save_pretrained folder
        model_cfg = ModelConfig(backend="hf")
    model_cfg = dataclasses.replace(model_cfg, backend="hf", init=str(folder))
    check_size(hf_param_count(folder), folder / CONFIG, "the model it describes")
    try:
        module, tokenizer = load_hf(folder, param_dtype(model_cfg))  # the dtype it was trained and saved in
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{folder}: cannot load the HF model ({exc})".replace("\n", " ")) from None
    _check_finite(module.state_dict().values(), folder)
    return Policy(module, tokenizer, model_cfg, device)


def load_extra_state(folder: str | Path) -> dict | None:
    """The `extra_state` saved with a policy, or None."""
    path = Path(folder) / STATE
    return _read_json(path) if path.is_file() else None


def init_policy(model_cfg: ModelConfig, tokenizer=None, device: str | torch.device | None = None) -> Policy:
    """Start a stage's policy: load `model_cfg.init` if it is a checkpoint, else :func:`build_policy`."""
    if model_cfg.init and is_checkpoint(model_cfg.init):
        return load_policy(model_cfg.init, device if device is not None else model_cfg.device)
    if model_cfg.backend == "gpt" and model_cfg.init:
        raise CheckpointError(f"{model_cfg.init}: model.init is not a checkpoint folder (no {MANIFEST})")
    if model_cfg.backend == "hf" and model_cfg.init and (Path(model_cfg.init) / CONFIG).is_file():
        folder = Path(model_cfg.init)  # a local HF folder: its size is checked before it is built
        _check_weight_files(folder)
        check_size(hf_param_count(folder), folder / CONFIG, "the model it describes")
    elif model_cfg.backend == "gpt":
        vocab = tokenizer.vocab_size if tokenizer is not None else 0
        check_size(gpt_param_count(GPTConfig.from_model_config(model_cfg, vocab)), Path("params"),
                   "model.* (n_layer, n_embd)")
    return build_policy(model_cfg, tokenizer, device)


# --------------------------------------------------------------------------- pickle-free state

def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able structure with tensors/arrays moved into `tensors` and replaced by references."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (tensors, arrays, JSON types only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and (if present) CUDA RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (missing parts are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(folder: str | Path, policy: Policy, optimizer: torch.optim.Optimizer | None,
                        scheduler_state: dict | None, rng_state: dict | None, extra: dict | None) -> Path:
    """Everything needed to resume bit-exactly, in one atomically written folder."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    doc = {
        "optimizer": _encode(optimizer.state_dict(), tensors) if optimizer is not None else None,
        "scheduler": _encode(scheduler_state, tensors),
        "rng": _encode(rng_state, tensors),
        "extra": _encode(extra, tensors),
    }
    with _atomic_folder(folder) as tmp:
        _write_policy_files(tmp, policy, None)
        if is_lora(policy.module):  # the merged weights cannot be split again: keep the adapters too
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state(policy.module).items()},
                      tmp / ADAPTER, metadata={"format": "pt"})
        save_file(tensors, tmp / TRAIN_TENSORS, metadata={"format": "pt"})
        (tmp / TRAIN_JSON).write_text(json.dumps(doc))
        _write_manifest(tmp)
    return Path(folder)


def load_training_state(folder: str | Path, policy: Policy,
                        optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore weights into `policy` and state into `optimizer` (in place, so wrappers such as DDP
    stay valid); return ``{"scheduler_state", "rng_state", "extra"}`` (RNG is not applied: call
    :func:`restore_rng_state`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    verify(folder)
    if policy.backend == "gpt":
        _load_gpt_weights(policy.module, folder / WEIGHTS, policy.device)
    elif is_lora(policy.module):  # the base is the stage's init, unchanged: restore the adapters
        try:
            load_adapter_state(policy.module, load_file(folder / ADAPTER, device="cpu"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{folder / ADAPTER}: cannot restore the LoRA adapters ({exc})") from None
    else:
        loaded = _load_hf_policy(folder, "cpu")
        policy.module.load_state_dict(loaded.module.state_dict())
    try:
        tensors = load_file(folder / TRAIN_TENSORS)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / TRAIN_TENSORS}: unreadable safetensors file ({exc})") from None
    doc = _read_json(folder / TRAIN_JSON)
    try:
        state = {k: _decode(doc[k], tensors) for k in ("optimizer", "scheduler", "rng", "extra")}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder / TRAIN_JSON}: malformed training state ({exc!r})") from None
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{folder / TRAIN_JSON}: no optimizer state saved")
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{folder / TRAIN_JSON}: optimizer state does not match ({exc})") from None
    return {"scheduler_state": state["scheduler"], "rng_state": state["rng"], "extra": state["extra"]}


# --------------------------------------------------------------------------- export

def export_hf(folder: str | Path, policy: Policy) -> Path:
    """Write a rope GPT policy as a plain transformers folder (``LlamaForCausalLM`` + a fast
    tokenizer with pad/eos set): loadable by ``AutoModelForCausalLM.from_pretrained`` and by
    :func:`load_policy`. HF policies are written with their own ``save_pretrained``."""
    from transformers.utils import logging as hf_logging

    from pipeline.tokenizer import EOS, PAD

    hf_logging.disable_progress_bar()
    if policy.backend != "gpt":
        with _atomic_folder(folder) as tmp:
            policy.module.save_pretrained(tmp)
            policy.tokenizer.save(tmp)
        return Path(folder)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from pipeline.model.hf import gpt_to_llama

    llama = gpt_to_llama(policy.module)  # on CPU: a copy of the weights
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(policy.tokenizer.to_str()),
                                     pad_token=PAD, eos_token=EOS)
    llama.config.pad_token_id, llama.config.eos_token_id = policy.tokenizer.pad_id, policy.tokenizer.eos_id
    llama.generation_config.pad_token_id = policy.tokenizer.pad_id
    llama.generation_config.eos_token_id = policy.tokenizer.eos_id
    with _atomic_folder(folder) as tmp:
        llama.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
    return Path(folder)
