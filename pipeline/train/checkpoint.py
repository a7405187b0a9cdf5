"""Checkpoints: safetensors + JSON, never pickle; written atomically; verified on load.

Policy folder (``save_policy`` / ``load_policy``):

- gpt backend: ``model.safetensors`` (weights; the tied head is stored once), ``config.json``
  (``{"format": "grpo-pipeline/gpt", "model": ModelConfig, "gpt": GPTConfig}``), ``tokenizer.json``;
- hf backend: the ``save_pretrained`` files of the model and tokenizer (their own ``config.json``)
  plus ``pipeline.json`` (``{"format": "grpo-pipeline/hf", "model": ModelConfig}``);
- both: ``state.json`` (the caller's ``extra_state``, if any) and ``manifest.json``: byte size and
  SHA-256 of every other file. Loading checks it, so a truncated or corrupt file is refused with a
  :class:`~pipeline.core.errors.CheckpointError` naming the file.

Resumable training state: :mod:`pipeline.train.state`; atomic folders, the manifest and its
verification, and the size checks before a model is built: :mod:`pipeline.train.manifest`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from pipeline.core.config import ConfigError, ModelConfig
from pipeline.core.config_loading import section_from_dict
from pipeline.core.errors import CheckpointError
from pipeline.model.gpt import GPT, GPTConfig
from pipeline.model.lora import is_lora, merged_state_dict
from pipeline.model.policy import Policy, build_policy, param_dtype
from pipeline.train.manifest import (CONFIG, FORMAT_GPT, FORMAT_HF, HF_META, MANIFEST, STATE, TIED_KEYS, WEIGHTS,
                                          _atomic_folder, _check_weight_files, _read_json, _write_manifest, check_size,
                                          gpt_param_count, hf_param_count, is_checkpoint, verify)


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
    try:
        return section_from_dict("model", {k: v for k, v in raw.items() if k in names}, str(path))
    except ConfigError as exc:  # edited, or written by a version with other ranges: one line, not pydantic's
        raise CheckpointError(f"{exc} (in the checkpoint's saved model config)") from None


def _check_finite(tensors, path: Path) -> None:
    """CheckpointError if any floating-point tensor holds inf or nan or is beyond WEIGHT_LIMIT (a
    state saved after a blow-up: sampling from it fails, so it cannot continue)."""
    from pipeline.train.optim import WEIGHT_LIMIT

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


ARCH_FIELDS = ("backend", "n_layer", "n_head", "n_embd", "block_size", "positions")  # gpt: the checkpoint decides
HF_ARCH_FIELDS = ("backend",)
# how a run computes with the weights, not what they are: always the run's own (see with_run_keys)
RUNTIME_FIELDS = ("device", "dtype", "compile", "param_dtype", "gradient_checkpointing", "lora_rank", "lora_alpha",
                  "lora_targets", "num_threads", "cpu_kernels", "dropout")


def with_run_keys(saved: ModelConfig, run: ModelConfig | None, path: Path) -> ModelConfig:
    """The model config a run continues the checkpoint `path` with: the checkpoint's architecture
    (`saved`; the weights were made with it) and the run's `RUNTIME_FIELDS` (`--set model.compile=true`
    on a stage that starts from a checkpoint means this run compiles, whatever the run that saved it
    did). `run` None: the checkpoint's own values. Another backend is refused here, before a model is
    built: some run-time keys (gradient checkpointing, LoRA) exist for one backend only."""
    if run is None:
        return saved
    if run.backend != saved.backend:
        raise CheckpointError(f"model.backend = {run.backend!r} in this run's config, but {path} holds a "
                              f"{saved.backend!r} model; set model.backend = {saved.backend!r}")
    return dataclasses.replace(saved, **{name: getattr(run, name) for name in RUNTIME_FIELDS})


def check_architecture(expected, found, expected_from: str, checkpoint: Path) -> None:
    """CheckpointError (an InputError) naming both values when `checkpoint`'s model config disagrees with `expected`
    (warmup, control and grpo continue a checkpoint: model.* cannot resize it, and the KL needs one
    architecture)."""
    fields = ARCH_FIELDS if found.backend == "gpt" else HF_ARCH_FIELDS
    for name in fields:
        want, have = getattr(expected, name), getattr(found, name)
        if want != have:
            raise CheckpointError(f"model.{name} = {want!r} in {expected_from}, but {checkpoint} was written "
                                  f"with model.{name} = {have!r}; warmup, control and grpo continue their "
                                  f"checkpoint, so drop the override or re-run the stage that writes "
                                  f"{checkpoint} with it")


def load_policy(folder: str | Path, device: str | torch.device | None = None,
                run: ModelConfig | None = None) -> Policy:
    """Load a policy saved by :func:`save_policy` (either backend), or a plain HF model folder.

    A folder with a manifest (every checkpoint the pipeline writes) is verified against it first,
    whatever its backend; a model's size is computed from its config and checked
    (:func:`check_size`) before anything is built or read. `run`: the model config of the run that
    continues it, whose run-time keys replace the saved ones (:func:`with_run_keys`; its architecture
    keys are the caller's to check, :func:`check_architecture`). `device` None: `run.device`, else
    `auto` (CUDA if available), not the device of the machine that saved it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    device = device if device is not None else run.device if run is not None else "auto"
    if is_checkpoint(folder):
        verify(folder)
    _check_weight_files(folder)
    if (folder / HF_META).is_file():
        return _load_hf_policy(folder, device, run)
    meta = _read_json(folder / CONFIG)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{folder / CONFIG}: expected a JSON object")
    if meta.get("format") != FORMAT_GPT:
        if "model_type" in meta:  # a plain HF save_pretrained folder
            return _load_hf_policy(folder, device, run)
        raise CheckpointError(f"{folder / CONFIG}: neither a grpo-pipeline nor a HF model config")
    if not is_checkpoint(folder):
        verify(folder)  # a pipeline config without its manifest: refused as incomplete
    return _load_gpt_policy(folder, meta, device, run)


def _load_gpt_policy(folder: Path, meta: dict, device, run: ModelConfig | None = None) -> Policy:
    from pipeline.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder)
    except (ValueError, FileNotFoundError) as exc:
        raise CheckpointError(str(exc)) from None
    model_cfg = with_run_keys(_model_config(meta.get("model"), folder / CONFIG), run, folder)
    try:
        gpt_cfg = GPTConfig(**meta["gpt"])
        if run is not None:  # dropout is the run's (it changes no weight)
            gpt_cfg = dataclasses.replace(gpt_cfg, dropout=model_cfg.dropout)
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


def _load_hf_policy(folder: Path, device, run: ModelConfig | None = None) -> Policy:
    from pipeline.model.hf import load_hf

    if (folder / HF_META).is_file():
        verify(folder)
        model_cfg = _model_config(_read_json(folder / HF_META).get("model"), folder / HF_META)
    else:  # a plain save_pretrained folder
        model_cfg = ModelConfig(backend="hf")
    check_size(hf_param_count(folder), folder / CONFIG, "the model it describes")
    model_cfg = with_run_keys(dataclasses.replace(model_cfg, backend="hf", init=str(folder)), run, folder)
    try:
        module, tokenizer = load_hf(folder, param_dtype(model_cfg))  # the run's weight dtype, else the saved one
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
        return load_policy(model_cfg.init, device, run=model_cfg)
    if model_cfg.backend == "gpt" and model_cfg.init:
        hint = ("; it is a Hugging Face model folder: set model.backend=hf to start from it"
                if (Path(model_cfg.init) / CONFIG).is_file() else "")
        raise CheckpointError(f"{model_cfg.init}: model.init is not a checkpoint folder (no {MANIFEST}){hint}")
    if model_cfg.backend == "hf" and model_cfg.init and (Path(model_cfg.init) / CONFIG).is_file():
        folder = Path(model_cfg.init)  # a local HF folder: its size is checked before it is built
        _check_weight_files(folder)
        check_size(hf_param_count(folder), folder / CONFIG, "the model it describes")
    elif model_cfg.backend == "gpt":
        vocab = tokenizer.vocab_size if tokenizer is not None else 0
        check_size(gpt_param_count(GPTConfig.from_model_config(model_cfg, vocab)), Path("params"),
                   "model.* (n_layer, n_embd)")
    return build_policy(model_cfg, tokenizer, device)


# --------------------------------------------------------------------------- export

def export_hf(folder: str | Path, policy: Policy) -> Path:
    """Write a rope GPT policy as a plain transformers folder (``LlamaForCausalLM`` + a fast
    tokenizer with pad/eos set): loadable by ``AutoModelForCausalLM.from_pretrained`` and by
    :func:`load_policy`. HF policies are written with their own ``save_pretrained``."""
    from transformers.utils import logging as hf_logging

    from pipeline.data.tokenizer import EOS, PAD

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
