"""Reading a params file into a :class:`~pipeline.core.config.Config`.

``load_config(path, overrides)`` reads a params file (strict YAML: no duplicate keys, bounded size),
applies ``section.key=value`` overrides, builds the :class:`~pipeline.core.config.Config`, whose
pydantic sections check every key's type and range, then checks the rules that relate two keys.
Any mistake raises :class:`~pipeline.core.config.ConfigError` with a
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
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from pipeline.core.config import (BUILTIN_TASKS, Config, ConfigError, FieldsConfig, GRPOConfig, ModelConfig,
                                  TaskConfig)


# --------------------------------------------------------------------------- validation

def _relation_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    """(key, ok, what is allowed) for each rule that relates a key to another; a key's own range is
    its field's constraint in pipeline/core/config.py. One key is checked here alone: `model.device`,
    whose allowed names hold for a params file, while code may run a config on any torch device
    (tests/test_device.py's simulated accelerator)."""
    d, m, s, c = cfg.data, cfg.model, cfg.sft, cfg.control
    dropout_free = "1 while model.dropout > 0 (the ranks would draw their dropout masks from one seeded stream)"
    return [
        ("model.device", re.fullmatch(r"auto|cpu|cuda(:\d+)?", m.device) is not None, "auto, cpu, cuda or cuda:N"),
        ("model.n_embd", m.n_embd % m.n_head == 0, "an integer in [1, 65536] divisible by model.n_head"),
        ("model.backend", m.backend == "gpt" or bool(m.init), "model.init set to a HF model id or folder"),
        ("data.chat_template", not d.chat_template or m.backend == "hf",
         "true only with model.backend hf (the template is the HF tokenizer's)"),
        ("model.lora_rank", m.lora_rank == 0 or m.backend == "hf", "0 (off) unless model.backend is hf: LoRA needs it"),
        ("model.gradient_checkpointing", not m.gradient_checkpointing or m.backend == "hf",
         "true only with model.backend hf"),
        ("sft.max_len", s.max_len <= m.block_size, "an integer in [8, model.block_size]"),
        ("sft.arith_max_level", s.arith_max_level <= d.arith_max_level,
         "an integer in [0, data.arith_max_level] (0 = every level)"),
        ("sft.nproc", s.nproc == 1 or m.dropout == 0, dropout_free),
        ("control.nproc", c.nproc == 1 or m.dropout == 0, dropout_free),
        *(rule for name in ("warmup", "grpo") for rule in _grpo_rules(name, getattr(cfg, name), m.block_size)),
        *(rule for name in ("warmup", "grpo") for rule in _fsdp_rules(name, getattr(cfg, name), m)),
    ]


def _fsdp_rules(name: str, g: GRPOConfig, m: ModelConfig) -> list[tuple[str, bool, str]]:
    """`<stage>.parallel = fsdp` covers full fine-tuning in eager mode (what its tests run)."""
    sharded = g.parallel == "fsdp"
    return [
        (f"{name}.parallel", not sharded or m.lora_rank == 0,
         "ddp while model.lora_rank > 0 (LoRA trains a few adapter weights: ddp holds them on every rank)"),
        (f"{name}.parallel", not sharded or not m.compile, "ddp while model.compile is true"),
    ]


def _grpo_rules(name: str, g: GRPOConfig, block_size: int) -> list[tuple[str, bool, str]]:
    return [
        (f"{name}.minibatch_groups", g.minibatch_groups <= g.prompts_per_iter,
         "an integer in [0, prompts_per_iter] (0 = whole batch)"),
        (f"{name}.rollout_len", g.rollout_len < block_size, "an integer in [1, model.block_size)"),
        (f"{name}.prompts_per_iter", g.prompts_per_iter % g.nproc == 0,
         f"a multiple of {name}.nproc (prompts are sharded by process)"),
        (f"{name}.minibatch_groups", g.minibatch_groups % g.nproc == 0,
         f"a multiple of {name}.nproc (each process takes an equal share of a minibatch's groups)"),
        (f"{name}.fewshot_fade", g.fewshot_fade == 0 or g.fewshot_examples > 0,
         f"0 unless {name}.fewshot_examples > 0 (it fades the worked examples out)"),
        (f"{name}.fewshot_fade", g.fewshot_fade <= g.iterations,
         f"an integer in [0, {name}.iterations] (the examples are gone by the last iteration)"),
    ]


def _value(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


USER_DATA_DIR = "data_in"  # where a task's local source lies: a DVC dependency of prepare (dvc.yaml)


def _task_rules(cfg: Config) -> list[tuple[str, bool, str]]:
    """The stages name tasks that exist; each task's weights match its rewards, its answer type has the
    columns it needs, and a local source lies where DVC watches it."""
    known = (*BUILTIN_TASKS, *cfg.tasks)
    names = f"a built-in task ({', '.join(BUILTIN_TASKS)}) or a name under tasks"
    e = cfg.evaluate
    rules = [("warmup.task", cfg.warmup.task in known, names), ("grpo.task", cfg.grpo.task in known, names),
             *(("evaluate.tasks", t in known, names) for t in e.tasks)]
    for name, t in cfg.tasks.items():
        key = f"tasks.{name}"
        rules += [
            (f"{key}.reward_weights", len(t.reward_weights) == len(t.rewards),
             f"one weight per entry of {key}.rewards ({len(t.rewards)})"),
            (f"{key}.rewards", len({r.rsplit(':', 1)[-1] for r in t.rewards}) == len(t.rewards),
             "parts with different names (a function's name is its part's name, reward/<name>)"),
            (f"{key}.fields.numbers", t.answer != "expression" or bool(t.fields.numbers),
             "a column name: an expression answer needs the numbers to use"),
            (f"{key}.test_fraction", bool(t.test_split) or t.test_fraction > 0,
             f"a fraction in (0, 1) while {key}.test_split is empty (the test rows must come from somewhere)"),
            (f"{key}.source", not _is_local(t.source) or _under_user_data(t.source),
             f"a path under {USER_DATA_DIR}/ (prepare's DVC dependency: editing the data re-runs prepare) or a hub "
             "dataset id owner/name"),
        ]
    return rules


def _is_local(source: str) -> bool:
    """A path rather than a hub id `owner/name`: it exists here, or has a path's shape."""
    return (Path(source).exists() or source.startswith((".", "/", "~")) or source.count("/") != 1
            or Path(source).suffix in (".jsonl", ".json", ".parquet", ".csv") or Path(source.split("/")[0]).is_dir())


def _under_user_data(source: str) -> bool:
    root = Path(USER_DATA_DIR).resolve()
    return Path(source).expanduser().resolve().is_relative_to(root)


def validate(cfg: Config, source: str = "params") -> Config:
    for key, ok, allowed in [*_relation_rules(cfg), *_task_rules(cfg)]:
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
    """Parameters of the pipeline's GPT of this shape (`pipeline.train.manifest.gpt_param_count`, a module
    above this one): tied embedding, attention 4 h^2 and SwiGLU 12 h^2 a layer."""
    m, h = cfg.model, cfg.model.n_embd
    learned = m.block_size * h if m.positions == "learned" else 0
    return cfg.data.vocab_size * h + learned + m.n_layer * (16 * h * h + 2 * h) + h


def _train_state(weights: int, size: int, kl: bool) -> int:
    """Bytes of the weights, their gradients and the reference (with a KL term), in the weights' dtype,
    and the two AdamW moments, always fp32; bf16 weights add their fp32 masters (`pipeline.train.optim.MasterAdamW`):
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

_TYPE_NAMES = {"int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer",
               "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
               "string_type": "a string", "list_type": "a list"}  # pydantic's error type -> what a key expects
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "string_pattern_mismatch",
                 "too_short", "too_long"}


def _show(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bound(value: float) -> str:
    """A bound as written in the schema: `2**50` rather than its 16 digits."""
    if isinstance(value, int) and abs(value) >= 2**20 and abs(value) & (abs(value) - 1) == 0:
        return f"{'-' if value < 0 else ''}2**{abs(value).bit_length() - 1}"
    return str(value)


def _allowed(info: FieldInfo) -> str:
    """What a key allows, in words: its `allowed(...)` text, or its bounds (`an integer in [1, 1024]`)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return str(extra["allowed"])
    bounds: dict[str, Any] = {}
    for meta in info.metadata:
        for attr in ("ge", "gt", "le", "lt"):
            value = getattr(meta, attr, None)
            if value is not None and abs(value) < 2**63:
                for other in {"ge": ("gt",), "gt": ("ge",), "le": ("lt",), "lt": ("le",)}[attr]:
                    bounds.pop(other, None)
                bounds[attr] = value
    kind = "an integer" if info.annotation is int else "a number"
    low = "ge" in bounds and f"[{_bound(bounds['ge'])}" or "gt" in bounds and f"({_bound(bounds['gt'])}"
    high = "le" in bounds and f"{_bound(bounds['le'])}]" or "lt" in bounds and f"{_bound(bounds['lt'])})"
    if low and high:
        return f"{kind} in {low}, {high}"
    if low:
        return f"{kind} {'>=' if 'ge' in bounds else '>'} {low[1:]}"
    if high:
        return f"{kind} {'<=' if 'le' in bounds else '<'} {high[:-1]}"
    return f"{kind} in [-2**63, 2**63)"


def _problem(error: Mapping[str, Any], cls: type, section: str, source: str) -> str:
    """pydantic's first error for a section as the one line the CLI prints."""
    name = str(error["loc"][0]) if error["loc"] else ""
    key = f"{section}.{name}" + "".join(f"[{i}]" for i in error["loc"][1:])
    value, kind = _show(error["input"]), error["type"]
    names = list(cls.__pydantic_fields__)
    if kind == "unexpected_keyword_argument":
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        return f"{source}: unknown key {section}.{name}{hint}; allowed: {', '.join(names)}"
    if kind == "literal_error":
        allowed = [str(a) for a in typing.get_args(_literal_of(cls, error["loc"]))]
        close = difflib.get_close_matches(str(error["input"]), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{source}: {key} = {value} is not allowed{hint}; allowed: " + ", ".join(allowed)
    if kind == "finite_number" or (isinstance(error["input"], float) and not math.isfinite(error["input"])):
        return f"{source}: {key} = {value} is not allowed; expected a finite number"
    if kind in _TYPE_NAMES:
        return f"{source}: {key} = {value} has the wrong type; expected {_TYPE_NAMES[kind]}"
    if kind in _RANGE_ERRORS:
        info = cls.__pydantic_fields__[name]
        if info.annotation is float and not isinstance(error["input"], bool):
            with contextlib.suppress(TypeError, ValueError):  # the number a float key holds: 0.0, not 0
                value = _show(float(error["input"]))
        problem = "is out of range" if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") else "is not allowed"
        if len(error["loc"]) > 1:  # one item of a list: show the whole list
            value = _show(error["input"]) if kind.startswith("too_") else value
        return f"{source}: {key} = {value} {problem}; allowed: {_allowed(info)}"
    return f"{source}: {key} = {value}: {error['msg']}"


def _literal_of(cls: type, loc: tuple) -> Any:
    """The Literal type of the field (or list item) at `loc`."""
    tp = typing.get_type_hints(cls)[loc[0]]
    while typing.get_origin(tp) in (typing.Annotated, list, typing.List):
        tp = typing.get_args(tp)[0]
    return tp


def _build_section(default: Any, raw: Any, section: str, source: str) -> Any:
    """`default` (the section's default instance) with the keys of `raw` applied; the section's
    pydantic dataclass checks each key's type and range."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section {section!r} must be a mapping of keys to values")
    cls = type(default)
    names = list(cls.__pydantic_fields__)
    for key in raw:
        if not isinstance(key, str):  # a YAML key such as 1 or true
            raise ConfigError(f"{source}: unknown key {section}.{key}; allowed: {', '.join(names)}")
    try:
        return dataclasses.replace(default, **raw)
    except ValidationError as exc:
        raise ConfigError(_problem(exc.errors()[0], cls, section, source)) from None


def section_from_dict(section: str, raw: Any, source: str) -> Any:
    """One config section from the mapping `raw` over its defaults, checked as a params file's is:
    ConfigError naming `source`, the key and what it allows (a checkpoint's saved model section)."""
    return _build_section(getattr(Config(), section), raw, section, source)


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
    built = {s: _build_section(getattr(defaults, s), raw.get(s), s, source) for s in sections if s != "tasks"}
    cfg = Config(**built, tasks=_build_tasks(raw.get("tasks"), source))
    return validate(cfg, source)


def _build_tasks(raw: Any, source: str) -> dict[str, TaskConfig]:
    """The `tasks` section: a mapping of task names to task entries, each checked as a section is."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section 'tasks' must be a mapping of task names to task entries")
    tasks = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", name):
            raise ConfigError(f"{source}: tasks.{name} is not a task name; allowed: lowercase letters, digits and _, "
                              "starting with a letter, at most 40 characters")
        if name in BUILTIN_TASKS:
            raise ConfigError(f"{source}: tasks.{name} is a built-in task ({', '.join(BUILTIN_TASKS)}); give yours "
                              "another name")
        if not isinstance(entry, dict) or "source" not in entry:
            raise ConfigError(f"{source}: tasks.{name} must be a mapping with at least `source` (a file or folder "
                              "under data_in/, or a hub dataset id)")
        entry = dict(entry)
        fields = _build_section(FieldsConfig(), entry.pop("fields", None), f"tasks.{name}.fields", source)
        tasks[name] = _build_section(TaskConfig(source="-"), entry, f"tasks.{name}", source)
        tasks[name] = dataclasses.replace(tasks[name], fields=fields)
    return tasks


OVERRIDE_HELP = ("expected section.key=value in DVC's -S grammar (Hydra's), e.g. grpo.kl_coef=0.02 or "
                 "data.system_prompt='Be brief: {question}' (quote a value holding {, }, a comma, = or ~)")


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value), read by the grammar `dvc exp run -S` reads (Hydra's
    override parser, which DVC applies to params.yaml): one grammar for `--set` on the CLI, in a flow
    and under DVC, so a value means the same wherever it is given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(text)
    except HydraException as exc:
        problem = str(exc).strip().splitlines()[0]
        raise ConfigError(f"--set {text!r}: not an override ({problem}); {OVERRIDE_HELP}") from None
    key = override.key_or_group
    if override.type is not OverrideType.CHANGE or override.package is not None or "." not in key:
        raise ConfigError(f"--set {text!r}: {OVERRIDE_HELP}; every key exists in params.yaml, so no +, ++, ~ or @")
    if override.is_sweep_override():
        raise ConfigError(f"--set {text!r}: a sweep (a,b or range()) is one run per value; give one value per run")
    section, name = key.split(".", 1)
    return section, name, override.value()


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

# Plain scalars YAML 1.1 (PyYAML, this reader) and YAML 1.2 (ruamel, DVC's reader of params.yaml) read as
# different values: refused, so the pipeline never trains on a value DVC records as another.
_YAML11_ONLY = {
    "bool": (re.compile(r"(?i:yes|no|on|off)"), "true/false to YAML 1.1 (the pipeline's reader) but a string to "
             "YAML 1.2 (DVC's); write true or false, or quote it for the text"),
    "int": (re.compile(r"[-+]?(?:[0-9][0-9_]*(?::[0-5]?[0-9])+|0[0-7_]+)"), "a base-60 or octal number to YAML 1.1 "
            "(the pipeline's reader) but not to YAML 1.2 (DVC's); write the number in decimal, or quote it"),
    "float": (re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*"), "a base-60 number to YAML 1.1 (the "
              "pipeline's reader) but a string to YAML 1.2 (DVC's); write the number in decimal, or quote it"),
}


def _one_reading(kind: str):
    base = getattr(yaml.SafeLoader, f"construct_yaml_{kind}")
    pattern, why = _YAML11_ONLY[kind]

    def construct(loader: yaml.SafeLoader, node: yaml.ScalarNode):
        if pattern.fullmatch(node.value):
            raise ConfigError(f"{loader.name}:{node.start_mark.line + 1}: {node.value} is {why}")
        return base(loader, node)
    return construct


for _kind in _YAML11_ONLY:
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _one_reading(_kind))


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
        *parents, leaf = key.split(".")  # tasks.mine.fields.answer: nested mappings
        for part in parents:
            if not isinstance(sec, dict):
                break
            sec = sec.setdefault(part, {})
        if not isinstance(sec, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values")
        sec[leaf] = value
    return config_from_dict(raw, str(path))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, width=120)
