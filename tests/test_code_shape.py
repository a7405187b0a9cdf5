"""The shape of pipeline/ as docs/architecture.md draws it, read from the source with `ast`: every
module sits in one layer and imports only from layers below it (so there is no import circle and no
stage imports another), no function is over 60 lines, and no stage starts a process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"

# bottom to top; a module may import (at any depth of its code) only modules of lower layers
LAYERS = [
    ["core.errors", "core.config", "core.distributed", "core.progress", "rewards.parsing", "rewards.countdown", "data.countdown",
     "model.attention", "model.fast", "model.fast.packed", "model.hf_mask", "rl.masked"],
    ["core.config_loading", "core.files", "core.kernels", "core.lock", "core.summary",
     "rewards.verifiers", "data.tokenizer", "model.logprobs", "model.lora", "model.fast.fused_decode", "rl.loss"],
    ["core.cli", "data.schema", "data.prompts", "model.gpt", "model.hf", "train.optim", "tracking.common",
     "rewards.task_rewards"],
    ["core.config_render", "data.arithmetic", "data.sft_batches", "model.policy", "tracking.mlflow_client"],
    ["data.gsm8k", "rl.evaluation", "rl.rollout", "rl.update", "train.fsdp", "train.manifest", "tracking.mlflow_logger"],
    ["train.checkpoint", "tracking.mlflow_models", "data.sources"],
    ["train.state", "tracking.mlflow_backend", "data.tasks"],
    ["tracking", "tracking.compare"],
    ["rl.generation", "rl.group_sampling", "train.resume"],
    ["rl.metrics"],
    ["stages.prepare", "stages.sft", "stages.grpo", "stages.evaluate", "model.fetch", "policy_model"],
    ["stages"],
    ["__main__"],
]
# the top-level units, bottom to top: a unit imports only from itself and the units before it
UNITS = ["core", "rewards", "data", "model", "rl", "train", "tracking", "stages"]
PACKAGES = {"pipeline", "pipeline.core", "pipeline.data", "pipeline.model", "pipeline.rewards",
            "pipeline.rl", "pipeline.train"}  # no code


def _modules() -> dict[str, Path]:
    out = {}
    for path in PIPELINE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The pipeline module an import names (`pipeline.model.gpt.GPT` -> `pipeline.model.gpt`)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> set[str]:
    """Every pipeline module `module` imports, at module level or inside a function."""
    deps = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            deps |= {_resolve(a.name) for a in node.names if a.name.startswith("pipeline")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
            deps |= {_resolve(f"{node.module}.{a.name}") for a in node.names}
    return deps - {module} - PACKAGES


def layer_of(module: str) -> int:
    short = module.removeprefix("pipeline.")
    for i, names in enumerate(LAYERS):
        if short in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_code_shape.py (and docs/architecture.md)")


def test_every_module_has_a_layer():
    for module in set(MODULES) - PACKAGES:
        layer_of(module)
    listed = {f"pipeline.{m}" for names in LAYERS for m in names}
    assert listed <= set(MODULES), f"layers name modules that do not exist: {sorted(listed - set(MODULES))}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - PACKAGES))
def test_imports_go_only_to_lower_layers(module):
    """Downhill only: no circle, no stage importing another, no library module importing a stage."""
    here = layer_of(module)
    upward = sorted(d for d in imports_of(module) if layer_of(d) >= here)
    assert not upward, f"{module} (layer {here}) imports {upward} from its own layer or above"


ENTRY_POINTS = {"__main__", "policy_model"}  # the CLI; the MLflow Model's code file (models from code)


def test_pipeline_is_at_most_eight_units_each_importing_only_units_below():
    """pipeline/ holds the eight units of UNITS (packages a reader can name) beside __init__ and the
    entry points, and a unit's code imports only its own unit and those below it: no import runs back up.
    Tracking is a leaf under the training units' code: it imports neither rl, train nor stages."""
    top = {p.stem if p.is_file() else p.name for p in PIPELINE.iterdir()
           if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))} - {"__init__", *ENTRY_POINTS}
    assert top == set(UNITS), f"top-level units {sorted(top)} (expected {UNITS})"
    upward = []
    for module in sorted(set(MODULES) - {"pipeline", *(f"pipeline.{e}" for e in ENTRY_POINTS)}):
        unit = UNITS.index(module.split(".")[1])
        for dep in imports_of(module):
            if dep != "pipeline" and UNITS.index(dep.split(".")[1]) > unit:
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that run back up: " + "; ".join(upward)
    tracking = {f"{m} -> {d}" for m in MODULES if m.startswith("pipeline.tracking") for d in imports_of(m)
                if d.split(".")[1] in ("rl", "train", "stages")}
    assert not tracking, tracking


def test_the_import_graph_has_no_circle():
    graph = {m: imports_of(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_no_function_is_over_60_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines: " + "; ".join(long)


def test_stages_start_no_process_and_never_import_prefect():
    """The torchrun relaunch lives in the CLI; no stage spawns its own CLI. The one process pool in a
    stage is evaluate's: spawned workers that score checkpoints with the stage's own functions
    (`evaluate.jobs`), held byte-identical to one process by tests/test_evaluation.py."""
    for module, path in MODULES.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        assert "prefect" not in names, module
        if module.startswith("pipeline.stages"):
            allowed = {"multiprocessing"} if module == "pipeline.stages.evaluate" else set()
            assert not names & ({"subprocess", "multiprocessing"} - allowed), module


def test_the_walk_sees_imports_at_every_depth():
    """Not vacuous: module-level and function-level imports are both found."""
    assert {"pipeline.train.resume", "pipeline.rl.group_sampling", "pipeline.model.policy"} <= imports_of("pipeline.stages.grpo")
    assert "pipeline.model.hf" in imports_of("pipeline.model.policy")  # imported inside Policy.__init__


# what a stage's outputs do not depend on (dvc.yaml's header says why they are not deps)
NOT_DEPS = ("pipeline.core.config", "pipeline.core.errors", "pipeline.core.progress", "pipeline.core.lock", "pipeline.core.cli",
            "pipeline.tracking", "pipeline.core.summary")


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for d in imports_of(m):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


STAGE_MODULES = {"warmup": "stages.grpo", "control": "stages.sft", "model": "model.fetch"}
DVC_FILES = {"dvc.yaml": ["prepare", "sft", "warmup", "control", "grpo", "evaluate"],
             "recipes/smollm2/dvc.yaml": ["model", "prepare", "sft", "warmup", "grpo", "evaluate"]}


@pytest.mark.parametrize("dvcfile,stage", [(f, s) for f, stages in DVC_FILES.items() for s in stages])
def test_dvc_deps_cover_the_code_each_stage_runs(dvcfile, stage):
    """Every pipeline module a stage imports (transitively) is a dep of its DVC stage, in the default
    pipeline and in each recipe's (whose paths are relative to its folder), so editing it re-runs the
    stage; observability-only modules are left out on purpose."""
    import os

    import yaml

    deps = yaml.safe_load((ROOT / dvcfile).read_text())["stages"][stage]["deps"]
    folder = (ROOT / dvcfile).parent
    code = [os.path.relpath(folder / d, ROOT).rstrip("/") for d in deps]
    code = [d for d in code if d.startswith("pipeline")]
    module = f"pipeline.{STAGE_MODULES.get(stage, f'stages.{stage}')}"
    missing = []
    for m in sorted(_closure(module) | {module}):
        if m.startswith(NOT_DEPS):
            continue
        path = str(MODULES[m].relative_to(ROOT))
        if not any(path == d or path.startswith(d + "/") for d in code):
            missing.append(path)
    assert not missing, f"{dvcfile} stage {stage} lacks deps {missing}"


def test_the_library_opens_neither_dvc_yaml_nor_dvc_lock():
    """DVC owns its files: what a stage reads and writes is the stage table's (held to dvc.yaml by
    tests/test_dvc.py), hashes are DVC's. The one mention allowed: dvc.lock among the paths a git-state
    check leaves out (tracking/common.py's OUTPUT_PATHS), which reads git, not the file."""
    named = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 60 and (
                    "dvc.yaml" in node.value or "dvc.lock" in node.value):
                named.append((module, node.lineno, node.value))
    assert named == [("pipeline.tracking.common", 34, "dvc.lock")], named
