"""params.yaml written from the config sections: their defaults, section and field docstrings.

Regenerate with ``python -m pipeline.core.config_render > params.yaml``. With a params file, its values
in full, for `dvc repro` on them: ``python -m pipeline.core.config_render configs/smoke.yaml > params.yaml``
(a file in ``configs/`` holds only the keys it changes; DVC reads params.yaml, which must hold every key).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import yaml

from pipeline.core.config import Config


PARAMS_HEADER = """\
# The single source of knobs: one section per stage, mirrored 1:1 by pipeline/core/config.py.
# Override any value on the CLI with --set section.key=value, or with `dvc exp run -S section.key=value`.
# Written from pipeline/core/config.py (defaults and docstrings): python -m pipeline.core.config_render > params.yaml
"""


TASKS_HEADER = """\
# --- tasks: your own tasks, each a name with its data, prompt, answer type and rewards (docs/own-task.md);
# the stages pick theirs with warmup.task, grpo.task and evaluate.tasks. Built-in: gsm8k, arith, countdown.
#   tasks:
#     mine:
#       source: data_in/mine            # folder with train/test files, a file, or a hub id
#       fields: {question: q, answer: ans}
#       answer: number                  # number, text, choice, expression or module:function
#       rewards: [correct, format, "mypkg.rewards:brevity"]
#       reward_weights: [1.0, 0.2, 0.1]
# Keys and defaults of an entry: pipeline/core/config.py (TaskConfig, FieldsConfig).
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config section (pydantic reads it: ``use_attribute_docstrings``),
    from the class that declares the field (a subclass, such as the warmup's, inherits its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if hasattr(k, "__pydantic_fields__")]):
        for name in vars(klass).get("__annotations__", {}):
            description = klass.__pydantic_fields__[name].description
            if description:
                docs[name] = " ".join(description.split())
    return docs


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)  # a double-quoted YAML string on one line
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).splitlines()[0]


def render_params(cfg: Config) -> str:
    """params.yaml for `cfg`: each section under its dataclass's docstring, each key under its field's."""
    import textwrap

    lines = [PARAMS_HEADER.rstrip()]
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if f.name == "tasks":
            lines += ["", TASKS_HEADER.rstrip(), yaml.safe_dump({"tasks": cfg.to_dict()["tasks"]}, sort_keys=False,
                                                               width=108).rstrip()]
            continue
        lines += ["", f"# --- {f.name}: {type(section).__doc__.strip()}", f"{f.name}:"]
        docs = field_docs(type(section))
        for key in dataclasses.fields(section):
            lines += textwrap.wrap(docs[key.name], 108, initial_indent="  # ", subsequent_indent="  # ")
            lines.append(f"  {key.name}: {_yaml_scalar(getattr(section, key.name))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from pipeline.core.cli import exit_status
    from pipeline.core.config_loading import load_config

    if len(argv) > 1 or argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m pipeline.core.config_render [PARAMS_FILE] > params.yaml", file=sys.stderr)
        return 2
    def render() -> int:
        print(render_params(load_config(argv[0]) if argv else Config()), end="")
        return 0
    return exit_status(render)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
