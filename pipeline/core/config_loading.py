"""Reading a params file into a :class:`~pipeline.core.config.Config`.

``load_config(path, overrides)`` reads a params file (strict YAML: no duplicate keys, bounded size),
applies ``section.key=value`` overrides, checks every key, type and range, and returns the
:class:`~pipeline.core.config.Config`. Any mistake raises :class:`~pipeline.core.config.ConfigError` with a
one-line message naming the file, the key and what is allowed; the CLI prints it and exits with status 2.

Sizes have upper bounds no real run reaches (a value past them is a slip that would ask for gigabytes
to terabytes), and the memory a config needs where the config alone tells it (prepare's rows; the gpt
backend's model and batches on the CPU) is estimated and compared with this machine's memory: a run
that cannot fit stops before any work, with one line naming the key, not an OOM kill later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import resource
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.core.config import Config, ConfigError, GRPOConfig


# --------------------------------------------------------------------------- validation

EVAL_STAGES = ("sft", "control", "warmup", "grpo")  # the training stages whose checkpoint evaluate scores
_REWARD_SPEC = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")


def is_reward_spec(spec: str) -> bool:
    """Empty, or `module:function` with dotted identifiers (imported by name, never evaluated)."""
    return spec == "" or _REWARD_SPEC.fullmatch(spec) is not None


def _range_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    """(key, ok, what is allowed) for every range rule; derived checks live here only."""
    w = cfg.warmup
    return [
        *_data_model_rules(cfg), *_sft_eval_rules(cfg),
        *(rule for name in ("warmup", "grpo") for rule in _grpo_rules(name, getattr(cfg, name), cfg.model.block_size)),
        ("warmup.min_informative", 0.0 <= w.min_informative <= 1.0, "a number in [0, 1]"),
        ("warmup.exit_accuracy", 0.0 <= w.exit_accuracy <= 1.0, "a number in [0, 1]"),
        ("warmup.max_extra_iters", w.max_extra_iters >= 0, "an integer >= 0"),
        ("warmup.level_floor", 0.0 < w.level_floor <= 1.0, "a number in (0, 1]"),
    ]


def _data_model_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    d, m = cfg.data, cfg.model
    return [
        ("data.val_size", d.val_size >= 0, "an integer >= 0"),
        ("data.max_bad_fraction", 0.0 <= d.max_bad_fraction <= 1.0, "a number in [0, 1]"),
        ("data.arith_train_size", 1 <= d.arith_train_size <= 10_000_000, "an integer in [1, 10000000]"),
        ("data.arith_eval_size", 1 <= d.arith_eval_size <= 1_000_000, "an integer in [1, 1000000]"),
        ("data.arith_max_level", 1 <= d.arith_max_level <= 5, "an integer in [1, 5]"),
        ("data.prompt_template", "{question}" in d.prompt_template, "a string containing {question}"),
        ("data.vocab_size", 300 <= d.vocab_size <= 1_000_000, "an integer in [300, 1000000]"),
        ("model.n_layer", 1 <= m.n_layer <= 1024, "an integer in [1, 1024]"),
        ("model.n_head", 1 <= m.n_head <= 1024, "an integer in [1, 1024]"),
        ("model.n_embd", 1 <= m.n_embd <= 65536 and m.n_embd % max(m.n_head, 1) == 0,
         "an integer in [1, 65536] divisible by model.n_head"),
        ("model.block_size", 16 <= m.block_size <= 131072, "an integer in [16, 131072]"),
        ("model.num_threads", 0 <= m.num_threads <= 4096, "an integer in [0, 4096] (0 = torch's default)"),
        ("model.dropout", 0.0 <= m.dropout < 1.0, "a number in [0, 1)"),
        ("model.device", re.fullmatch(r"auto|cpu|cuda(:\d+)?", m.device) is not None,
         "auto, cpu, cuda or cuda:N"),
        ("model.backend", m.backend == "gpt" or bool(m.init), "model.init set to a HF model id or folder"),
        ("data.chat_template", not d.chat_template or m.backend == "hf",
         "true only with model.backend hf (the template is the HF tokenizer's)"),
        ("model.lora_rank", m.lora_rank >= 0 and (m.lora_rank == 0 or m.backend == "hf"),
         "an integer >= 0 (0 = off); LoRA needs model.backend hf"),
        ("model.lora_alpha", m.lora_alpha > 0, "a number > 0"),
        ("model.lora_targets", bool(m.lora_targets) and all(t.strip() for t in m.lora_targets),
         "a non-empty list of module names, e.g. [q_proj, v_proj]"),
        ("model.gradient_checkpointing", not m.gradient_checkpointing or m.backend == "hf",
         "true only with model.backend hf"),
    ]


def _sft_eval_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    m, s, e = cfg.model, cfg.sft, cfg.evaluate
    return [
        ("evaluate.reward", is_reward_spec(e.reward), "empty or module:function (e.g. mypkg.rewards:score)"),
        ("sft.steps", s.steps >= 0, "an integer >= 0"),
        ("sft.batch_size", 1 <= s.batch_size <= 65536, "an integer in [1, 65536]"),
        ("sft.lr", s.lr > 0, "a number > 0"),
        ("sft.warmup_steps", s.warmup_steps >= 0, "an integer >= 0"),
        ("sft.weight_decay", s.weight_decay >= 0, "a number >= 0"),
        ("sft.grad_clip", s.grad_clip > 0, "a number > 0"),
        ("sft.arith_fraction", 0.0 <= s.arith_fraction <= 1.0, "a number in [0, 1]"),
        ("sft.max_len", 8 <= s.max_len <= m.block_size, "an integer in [8, model.block_size]"),
        ("sft.log_every", s.log_every >= 1, "an integer >= 1"),
        ("sft.eval_every", s.eval_every >= 0, "an integer >= 0"),
        ("sft.eval_samples", s.eval_samples >= 0, "an integer >= 0"),
        ("sft.save_every", s.save_every >= 1, "an integer >= 1"),
        ("sft.keep_last", s.keep_last >= 1, "an integer >= 1"),
        ("sft.max_nonfinite", s.max_nonfinite >= 1, "an integer >= 1"),
        ("sft.arith_examples", s.arith_examples >= 0, "an integer >= 0 (0 = all)"),
        ("sft.arith_max_level", 0 <= s.arith_max_level <= cfg.data.arith_max_level,
         "an integer in [0, data.arith_max_level] (0 = every level)"),
        ("sft.arith_hard_examples", s.arith_hard_examples >= 0, "an integer >= 0"),
        ("sft.num_threads", 0 <= s.num_threads <= 4096, "an integer in [0, 4096] (0 = model.num_threads)"),
        ("sft.nproc", 1 <= s.nproc <= 1024, "an integer in [1, 1024]"),
        ("sft.nproc", s.nproc == 1 or m.dropout == 0,
         "1 while model.dropout > 0 (the ranks would draw their dropout masks from one seeded stream)"),
        *_control_rules(cfg),
        ("evaluate.gsm8k_limit", e.gsm8k_limit >= 0, "an integer >= 0 (0 = all)"),
        ("evaluate.arith_limit", e.arith_limit >= 0, "an integer >= 0 (0 = all)"),
        ("evaluate.batch_size", 1 <= e.batch_size <= 65536, "an integer in [1, 65536]"),
        ("evaluate.max_new_tokens", 1 <= e.max_new_tokens <= 131072, "an integer in [1, 131072]"),
        ("evaluate.samples", 0 <= e.samples <= 1024, "an integer in [0, 1024] (0 = off)"),
        ("evaluate.jobs", e.jobs >= 0, "an integer >= 0 (0 = auto)"),
        ("evaluate.sample_tasks", all(x in ("gsm8k", "arith") for x in e.sample_tasks),
         "a list drawn from gsm8k, arith"),
        ("evaluate.temperature", e.temperature > 0, "a number > 0"),
        ("evaluate.top_p", 0.0 < e.top_p <= 1.0, "a number in (0, 1]"),
        ("evaluate.stages", bool(e.stages) and all(x in EVAL_STAGES for x in e.stages),
         f"a non-empty list drawn from {', '.join(EVAL_STAGES)}"),
        ("evaluate.fewshot_stages", all(x in EVAL_STAGES for x in e.fewshot_stages),
         f"a list drawn from {', '.join(EVAL_STAGES)}"),
        ("evaluate.fewshot_examples", 1 <= e.fewshot_examples <= 16, "an integer in [1, 16]"),
        ("tracking.experiment", bool(cfg.tracking.experiment.strip()), "a non-empty name"),
        ("tracking.log_model_max_mb", cfg.tracking.log_model_max_mb >= 0, "a number >= 0 (0 = never)"),
    ]


def _control_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    c = cfg.control
    return [
        ("control.steps", c.steps >= 0, "an integer >= 0"),
        ("control.lr", c.lr > 0, "a number > 0"),
        ("control.warmup_steps", c.warmup_steps >= 0, "an integer >= 0"),
        ("control.eval_every", c.eval_every >= 0, "an integer >= 0"),
        ("control.nproc", 1 <= c.nproc <= 1024, "an integer in [1, 1024]"),
        ("control.nproc", c.nproc == 1 or cfg.model.dropout == 0,
         "1 while model.dropout > 0 (the ranks would draw their dropout masks from one seeded stream)"),
    ]


def _grpo_rules(name: str, g: GRPOConfig, block_size: int) -> list[tuple[str, bool, str]]:
    return [
        (f"{name}.iterations", g.iterations >= 0, "an integer >= 0"),
        # the sampling streams are seeded with seed * 7919 + epoch and seed * 1000 + rank
        (f"{name}.seed", -2**50 <= g.seed < 2**50, "an integer in [-2**50, 2**50)"),
        (f"{name}.prompts_per_iter", 1 <= g.prompts_per_iter <= 65536, "an integer in [1, 65536]"),
        (f"{name}.group_size", 2 <= g.group_size <= 1024, "an integer in [2, 1024] (a group needs peers)"),
        (f"{name}.grpo_epochs", g.grpo_epochs >= 1, "an integer >= 1"),
        (f"{name}.minibatch_groups", 0 <= g.minibatch_groups <= g.prompts_per_iter,
         "an integer in [0, prompts_per_iter] (0 = whole batch)"),
        (f"{name}.lr", g.lr > 0, "a number > 0"),
        (f"{name}.warmup_iters", g.warmup_iters >= 0, "an integer >= 0"),
        (f"{name}.weight_decay", g.weight_decay >= 0, "a number >= 0"),
        (f"{name}.clip", 0.0 < g.clip < 1.0, "a number in (0, 1)"),
        (f"{name}.clip_high", g.clip_high == 0.0 or 0.0 < g.clip_high < 10.0,
         "0 (same as clip) or a number in (0, 10)"),
        (f"{name}.kl_coef", g.kl_coef >= 0, "a number >= 0"),
        (f"{name}.temperature", g.temperature > 0, "a number > 0"),
        (f"{name}.top_p", 0.0 < g.top_p <= 1.0, "a number in (0, 1]"),
        (f"{name}.top_k", g.top_k >= 0, "an integer >= 0 (0 = off)"),
        (f"{name}.rollout_len", 1 <= g.rollout_len < block_size, "an integer in [1, model.block_size)"),
        (f"{name}.grad_clip", g.grad_clip > 0, "a number > 0"),
        (f"{name}.max_sampling_rounds", g.max_sampling_rounds >= 1, "an integer >= 1"),
        (f"{name}.max_nonfinite", g.max_nonfinite >= 1, "an integer >= 1"),
        (f"{name}.log_every", g.log_every >= 1, "an integer >= 1"),
        (f"{name}.eval_every", g.eval_every >= 0, "an integer >= 0 (0 = off)"),
        (f"{name}.eval_samples", g.eval_samples >= 0, "an integer >= 0"),
        (f"{name}.save_every", g.save_every >= 1, "an integer >= 1"),
        (f"{name}.keep_last", g.keep_last >= 1, "an integer >= 1"),
        (f"{name}.nproc", 1 <= g.nproc <= 1024, "an integer in [1, 1024]"),
        (f"{name}.prompts_per_iter", g.prompts_per_iter % max(g.nproc, 1) == 0,
         f"a multiple of {name}.nproc (prompts are sharded by process)"),
        (f"{name}.minibatch_groups", g.minibatch_groups % max(g.nproc, 1) == 0,
         f"a multiple of {name}.nproc (each process takes an equal share of a minibatch's groups)"),
        (f"{name}.micro_batch_size", g.micro_batch_size >= 0, "an integer >= 0 (0 = the whole minibatch)"),
        (f"{name}.reward", is_reward_spec(g.reward), "empty or module:function (e.g. mypkg.rewards:score)"),
    ]


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config, source: str = "params") -> Config:
    for key, ok, allowed in _range_rules(cfg):
        if not ok:
            raise ConfigError(f"{source}: {key} = {_show(_value(cfg, key))} is out of range; allowed: {allowed}")
    _check_memory(cfg, source)
    return cfg


# --------------------------------------------------------------------------- memory

GB = 1e9
# prepare holds every arithmetic row, the texts its tokenizer trains on and the JSONL it writes: a peak of
# 0.4 GB at 20,000 rows and 1.7 GB at 200,000 (measured), ~7.5 kB a row
PREPARE_ROW_BYTES = 7_500
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's ROCm
MODEL_KEYS = ("model.n_layer", "model.n_embd", "data.vocab_size")


def _cgroup_limit() -> int | None:
    """This container's memory limit (cgroup v2, else v1); None where there is none."""
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def machine_memory() -> tuple[int, str] | None:
    """(bytes, how) this process can use at most: the physical memory, the cgroup's limit or the
    address-space limit (`ulimit -v`), whichever is least; None where none can be read."""
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of memory"))
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append((cgroup, "under its cgroup's memory limit"))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "under its address-space limit (ulimit -v)"))
    return min(limits) if limits else None


def has_gpu() -> bool:
    """Whether `model.device = auto` takes a GPU here, told without importing torch (seconds): a GPU
    driver's device file, unless CUDA_VISIBLE_DEVICES hides every device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return any(Path(p).exists() for p in GPU_DEVICES)


def _gpt_params(cfg: Config) -> int:
    """Parameters of the pipeline's GPT of this shape (`checkpoint_manifest.gpt_param_count`, a module
    above this one): tied embedding, attention 4 h^2 and SwiGLU 12 h^2 a layer."""
    m, h = cfg.model, cfg.model.n_embd
    learned = m.block_size * h if m.positions == "learned" else 0
    return cfg.data.vocab_size * h + learned + m.n_layer * (16 * h * h + 2 * h) + h


def _train_state(weights: int, size: int, kl: bool) -> int:
    """Bytes of the weights, their gradients and the reference (with a KL term), in the weights' dtype,
    and the two AdamW moments, always fp32; bf16 weights add their fp32 masters (`training.MasterAdamW`):
    20 bytes a parameter in fp32, 18 in bf16 (with the reference)."""
    params = weights // size
    return params * (size * (3 if kl else 2) + 8 + (4 if size == 2 else 0))


def _grpo_need(cfg: Config, name: str, weights: int, size: int) -> tuple[str, int, tuple[str, ...]]:
    """A GRPO stage: weights, gradients, two AdamW moments (and fp32 masters under bf16) and the
    reference (with a KL term), then the larger of the rollout's preallocated KV cache (every row,
    `rollout_len` positions) and one training pass's logits (a micro-batch per process, else the
    minibatch; `rollout_len` columns)."""
    g, m, vocab = getattr(cfg, name), cfg.model, cfg.data.vocab_size
    rows = g.prompts_per_iter * g.group_size
    forward = (g.minibatch_groups or g.prompts_per_iter) * g.group_size
    if g.micro_batch_size:
        forward = min(forward, g.micro_batch_size * g.nproc)
    kv = 2 * rows * g.rollout_len * m.n_layer * m.n_embd * size
    logits = forward * g.rollout_len * vocab * size
    batch, model = max(kv, logits), _train_state(weights, size, g.kl_coef > 0)
    keys = (*MODEL_KEYS, f"{name}.prompts_per_iter", f"{name}.group_size", f"{name}.rollout_len")
    what = f"{name}: weights, AdamW and reference {model / GB:,.1f} GB + rollout batch {batch / GB:,.1f} GB"
    return what, model + batch, keys


def _evaluate_need(cfg: Config, weights: int, size: int) -> tuple[str, int, tuple[str, ...]]:
    """evaluate: the weights, and one generation batch's KV cache (`batch_size` prompts x `samples`
    rows; new tokens up to `max_new_tokens`, counted as no more than half the context) and logits."""
    e, m = cfg.evaluate, cfg.model
    rows = e.batch_size * (max(1, e.samples) if e.sample_tasks else 1)
    new = min(e.max_new_tokens, m.block_size // 2)
    batch = rows * (2 * new * m.n_layer * m.n_embd + cfg.data.vocab_size) * size
    keys = (*MODEL_KEYS, "evaluate.batch_size", "evaluate.samples", "evaluate.max_new_tokens")
    return f"evaluate: weights {weights / GB:,.1f} GB + generation batch {batch / GB:,.1f} GB", weights + batch, keys


def memory_needs(cfg: Config) -> list[tuple[str, int, tuple[str, ...]]]:
    """(what, bytes, the keys it grows with) of each stage at its peak, counted low: prepare's rows
    for any backend and device; for the gpt backend on the CPU, the model and its largest batch (an
    hf model's size is the model's, not the config's; a GPU's memory is not this machine's)."""
    needs = [(f"prepare: {cfg.data.arith_train_size:,} arithmetic rows", PREPARE_ROW_BYTES * cfg.data.arith_train_size,
              ("data.arith_train_size",))]
    m = cfg.model
    if m.backend != "gpt" or not (m.device == "cpu" or (m.device == "auto" and not has_gpu())):
        return needs
    size = 2 if m.param_dtype == "bfloat16" else 4
    weights = _gpt_params(cfg) * size
    return [*needs, *(_grpo_need(cfg, name, weights, size) for name in ("warmup", "grpo")),
            _evaluate_need(cfg, weights, size)]


def _check_memory(cfg: Config, source: str) -> None:
    """One line naming the likeliest key (the one furthest above its default) when a stage needs more
    memory than this machine has: before any work, not an OOM kill or a MemoryError minutes later."""
    have = machine_memory()
    what, need, keys = max(memory_needs(cfg), key=lambda n: n[1])
    if have is None or need <= have[0]:
        return
    default = Config()
    key = max(keys, key=lambda k: _value(cfg, k) / max(_value(default, k), 1))
    raise ConfigError(f"{source}: {key} = {_show(_value(cfg, key))}: needs ~{need / GB:,.1f} GB of memory ({what}), "
                      f"more than the {have[0] / GB:,.1f} GB this machine has {have[1]}; lower {key}")


# --------------------------------------------------------------------------- parsing

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _show(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


INT_LIMIT = 2**63  # integers (seeds, sizes) must fit a signed 64-bit value: numpy and torch seeds do


def _number(value: Any, tp: type, key: str, source: str) -> Any:
    """A finite number for an int or float field; `.inf`, `.nan` and ints beyond int64 are refused."""
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string; accept it as the number it means
            value = float(value)
        except ValueError:
            return value
    if tp is float and isinstance(value, int):
        if abs(value) >= 2**1023:
            raise ConfigError(f"{source}: {key} = {_show(value)} is out of range; expected a finite number")
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {key} = {_show(value)} is not allowed; expected a finite number")
    if isinstance(value, int) and not -INT_LIMIT <= value < INT_LIMIT:
        raise ConfigError(f"{source}: {key} = {_show(value)} is out of range; expected an integer in [-2**63, 2**63)")
    return value


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{source}: {key} = {_show(value)} is not allowed{hint}; allowed: "
                              + ", ".join(map(str, allowed)))
        return value
    if origin in (list, typing.List):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} = {_show(value)} has the wrong type; expected a list")
        return [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key, source)
    if tp in (int, float) and not isinstance(value, bool):
        value = _number(value, tp, key, source)
    if isinstance(value, bool) and tp is not bool:
        raise ConfigError(f"{source}: {key} = {_show(value)} has the wrong type; expected {_TYPE_NAMES[tp]}")
    if not isinstance(value, tp):
        raise ConfigError(f"{source}: {key} = {_show(value)} has the wrong type; expected {_TYPE_NAMES.get(tp, tp)}")
    return value


def _build_section(default: Any, raw: Any, section: str, source: str) -> Any:
    """`default` (the section's default instance) with the keys of `raw` checked and applied."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section {section!r} must be a mapping of keys to values")
    cls = type(default)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {section}.{close[0]}?)" if close else ""
            raise ConfigError(f"{source}: unknown key {section}.{key}{hint}; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}", source)
    return dataclasses.replace(default, **kwargs)


def config_from_dict(raw: Any, source: str = "params") -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    defaults = Config()
    sections = [f.name for f in dataclasses.fields(Config)]
    for key in raw:
        if key not in sections:
            close = difflib.get_close_matches(str(key), sections, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{source}: unknown section {key!r}{hint}; allowed: {', '.join(sections)}")
    cfg = Config(**{s: _build_section(getattr(defaults, s), raw.get(s), s, source) for s in sections})
    return validate(cfg, source)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, YAML-parsed value)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. grpo.kl_coef=0.02")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = yaml.safe_load(rhs) if rhs.strip() else ""
    except yaml.YAMLError:
        value = rhs
    return section, key, value


MAX_PARAMS_BYTES = 1 << 20  # a params file is a few kB; anything this large is not one


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)
    and aliases (`*name`): a params file has no use for them, and nested aliases expand
    exponentially (a few lines that take the machine down when printed in an error)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"{self.name}:{event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                              "allowed in a params file; write the value out")
        return super().compose_node(parent, index)


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
            seen[key] = line
        except TypeError:  # an unhashable key: let the default constructor report it
            continue
        if first is not None:
            raise ConfigError(f"{loader.name}:{line}: duplicate key {key!r} (first given on line {first}); "
                              "each section and key may appear once")
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _params_text(path: Path) -> str:
    """The params file as text: refused if too large, not UTF-8 text, or holding NUL bytes."""
    try:
        size = path.stat().st_size
        if size > MAX_PARAMS_BYTES:
            raise ConfigError(f"{path}: {size} bytes is too large for a params file (at most {MAX_PARAMS_BYTES})")
        data = path.read_bytes()
    except OSError as exc:  # unreadable (permissions, an I/O error): one line, not a traceback
        raise ConfigError(f"{path}: cannot read the params file ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not a UTF-8 text file (byte {exc.start}); a params file is YAML text") from None
    if "\0" in text:
        line = text[:text.index("\0")].count("\n") + 1
        raise ConfigError(f"{path}:{line}: holds a NUL byte; a params file is YAML text, not binary")
    return text


def read_params(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found (pass --params FILE or run where params.yaml is)")
    loader = _UniqueKeyLoader(_params_text(path))
    loader.name = str(path)
    try:
        raw = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or exc).replace("\n", " ")
        raise ConfigError(f"{path}{where}: not valid YAML ({problem})") from None
    finally:
        loader.dispose()
    if raw is None or raw == {}:
        raise ConfigError(f"{path}: the params file is empty; it must hold the stage sections "
                          "(see params.yaml), an empty file would silently run every default")
    return raw


def load_config(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Config:
    raw = read_params(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for text in overrides or []:
        section, key, value = parse_override(text)
        sec = raw.setdefault(section, {})
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values")
        sec[key] = value
    return config_from_dict(raw, str(path))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, width=120)
