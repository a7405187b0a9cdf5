"""dvc.yaml: structure checks (fast), and under `slow`: `dvc repro` of prepare, and the whole smoke
pipeline under DVC: repro, no-op repro, experiments, metrics/plots diff, push/pull to a local remote. Every DVC command runs in a temporary git copy of the repo with the smoke params."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import STAGES, Config
from tests.conftest import GSM8K, QUIET_ENV, REPO, copy_repo, output_files, smoke_outputs

BIN = Path(sys.executable).parent
DVC_ENV = {**os.environ, **QUIET_ENV, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def sh(cwd: Path, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `dvc ...` (through this interpreter, so `python` in stage commands is the same env) or git."""
    cmd = [sys.executable, "-m", "dvc", *args[1:]] if args[0] == "dvc" else list(args)
    proc = subprocess.run(cmd, cwd=cwd, env=DVC_ENV, capture_output=True, text=True, check=False, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def ran(proc: subprocess.CompletedProcess) -> list[str]:
    """Stages DVC actually executed (not skipped or restored from the run cache)."""
    return re.findall(r"Running stage '([a-z]+)'", proc.stdout + proc.stderr)


def spec() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())


# --------------------------------------------------------------------------- structure (fast)

def test_the_stage_table_and_dvc_yaml_declare_one_graph():
    """What each stage of pipeline.core.config.STAGE_TABLE starts from and reads is a dependency of
    that stage in dvc.yaml, and its checkpoint an output, so the table and DVC cannot drift apart."""
    from pipeline.core.config import STAGE_TABLE, Config
    from pipeline.data.tasks import task_files

    def paths(entries) -> set[str]:  # `- path` or `- path: {cache: false}`
        return {next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []}

    stages = spec()["stages"]
    for row in STAGE_TABLE:
        deps, outs = set(stages[row.name]["deps"]), paths(stages[row.name].get("outs"))
        task = getattr(Config(), row.name).task if row.kind == "grpo" else None  # its default task's files
        reads = {f"checkpoints/{c}" for c in (row.init, row.reference) if c} | (
            {f"data/{task_files(task).train}", f"data/{task_files(task).val}", "data/tasks"} if task else set())
        assert reads <= deps, (row.name, reads - deps)
        assert outs == set(row.outs), (row.name, outs ^ set(row.outs))
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2" / "dvc.yaml").read_text())["stages"]
    for row in STAGE_TABLE:
        if row.name in recipe:  # the recipe's stages write what the default's do (its `model` is its own)
            assert paths(recipe[row.name].get("outs")) == set(row.outs), row.name


def test_stages_commands_and_params_mirror_the_config():
    stages = spec()["stages"]
    assert list(stages) == list(STAGES)
    sections = set(Config().to_dict())
    for name, st in stages.items():
        assert st["cmd"] == f"python -m pipeline {name}"
        assert {p.split(".")[0] for p in st["params"]} <= sections and "tracking" not in st["params"]
    # the hf backend's prepare uses the model's own tokenizer (and chat template): those two model keys
    assert stages["prepare"]["params"] == ["data", "model.backend", "model.init", "tasks"]
    for name in ("sft", "warmup", "control", "grpo", "evaluate"):
        assert name in stages[name]["params"] or name == "evaluate" and "evaluate" in stages[name]["params"]


def _outs(st: dict) -> dict[str, dict]:
    out = {}
    for kind in ("outs", "metrics", "plots"):
        for item in st.get(kind, []):
            path, opts = (next(iter(item.items())) if isinstance(item, dict) else (item, {}))
            out[path] = {"kind": kind, **(opts or {})}
    return out


def resolved(dep: str, params: dict) -> str:
    """A dvc.yaml path with DVC's `${section.key}` templating filled in from params.yaml, as DVC does per run."""
    return re.sub(r"\$\{\s*([^}]+?)\s*\}", lambda m: str(_value(params, m.group(1))), dep)


def test_deps_exist_or_come_from_upstream_and_outs_follow_the_layout():
    stages = spec()["stages"]
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    # prepare's GSM8K is the configured source (templated), not a fixed path; the lock records it as DVC
    # resolves it (`./datasets/gsm8k` by default), so `dvc status` matches it without a re-run
    assert "${data.gsm8k_source}" in stages["prepare"]["deps"] and "datasets/gsm8k" not in stages["prepare"]["deps"]
    locked = [d["path"] for d in yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]["prepare"]["deps"]]
    assert resolved("${data.gsm8k_source}", params) in locked
    produced: set[str] = set()
    for name, st in stages.items():
        for dep in (resolved(d, params) for d in st["deps"]):
            assert dep in produced or (REPO / dep).exists(), f"{name}: dep {dep} neither in the repo nor upstream"
        code = [d for d in st["deps"] if d.startswith("pipeline/")]
        assert code, f"{name} lists no code deps"
        outs = _outs(st)
        produced |= set(outs)
        assert not any(".resume" in p for p in outs), "resumable state must survive `dvc repro`"
        if name in ("sft", "warmup", "control", "grpo"):
            assert outs[f"checkpoints/{name}"]["kind"] == "outs"
            assert outs[f"plots/{name}.csv"] == {"kind": "outs", "cache": False}  # drawn by the top-level plots
    ev = _outs(stages["evaluate"])
    assert ev["metrics/eval.json"] == {"kind": "metrics", "cache": False}
    assert {"plots/accuracy.csv", "plots/accuracy.png", "plots/training_curves.png", "reports"} <= set(ev)
    assert {f"data/{f}" for f in ("gsm8k_train.jsonl", "gsm8k_val.jsonl", "gsm8k_test.jsonl", "arith_train.jsonl",
                                  "arith_eval.jsonl", "tokenizer.json", "stats.json", "tasks")} == set(_outs(stages["prepare"]))
    assert ev["metrics/train.json"] == {"kind": "metrics", "cache": False}
    top = {name: p for item in spec()["plots"] if isinstance(item, dict) for name, p in item.items()}
    for signal in ("reward", "kl", "informative", "clipfrac"):  # one plot per signal, against the iteration
        assert top[signal]["x"] == "iteration" and top[signal]["y"] == {"plots/warmup.csv": signal,
                                                                        "plots/grpo.csv": signal}
    assert top["sft_loss"]["x"] == "step"
    assert top["sft_loss"]["y"] == {"plots/sft.csv": ["loss", "val_loss"], "plots/control.csv": ["loss", "val_loss"]}
    assert "checkpoints/sft" in stages["control"]["deps"] and "checkpoints/control" in stages["evaluate"]["deps"]
    assert stages["control"]["params"] == ["data", "model", "sft", "control"]  # sft's settings drive its loop
    assert top["accuracy"]["template"] == "accuracy_by_task"
    template = json.loads((REPO / ".dvc" / "plots" / "accuracy_by_task.json").read_text())
    assert template["encoding"]["row"]["field"] == "task"  # grouped by task


def _value(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree[key]
    return tree


def committed(path: str) -> bytes:
    """`path` as committed at git HEAD of REPO: the committed results, not what a run in this checkout
    rewrote (`make run` on another CPU class rewrites metrics/, plots/ and dvc.lock, as DVC does).
    Skips where REPO is not the top of a git checkout with a commit (an unpacked archive)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True, text=True)
        head = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=REPO, capture_output=True)
    except FileNotFoundError:
        pytest.skip("git is not installed: the committed results are read from git HEAD")
    if top.returncode or Path(top.stdout.strip()).resolve() != REPO.resolve() or head.returncode:
        pytest.skip(f"{REPO} is not a git checkout with a commit: the committed results are read from git HEAD")
    return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=REPO, capture_output=True, check=True).stdout


def test_the_committed_results_are_those_of_the_committed_params():
    """dvc.lock, metrics/ and the plot series on main come from one default run of params.yaml (so `dvc
    metrics diff` and `dvc exp show` compare against HEAD): every stage is locked with params.yaml's
    values, each metric and plot file DVC records is the one committed (md5), and metrics/eval.json
    holds every checkpoint the evaluate stage scores, the control beside the warmup. Every file is read
    as committed at HEAD (`committed`), never from the workspace, which a user's run may have rewritten."""
    import hashlib

    from ruamel.yaml import YAML

    yaml12 = YAML(typ="safe")  # DVC's YAML 1.2 reading: `5e-05` is a number (PyYAML reads a string)
    lock = yaml12.load(committed("dvc.lock"))["stages"]
    assert set(lock) == set(yaml.safe_load(committed("dvc.yaml"))["stages"])
    params = yaml12.load(committed("params.yaml"))
    tracked = set(subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "--", "metrics", "plots", "dvc.lock"],
                                 cwd=REPO, check=True, capture_output=True, text=True).stdout.split())
    recorded = set()
    for name, st in lock.items():
        for key, value in st["params"]["params.yaml"].items():
            assert _value(params, key) == value, f"dvc.lock: stage {name} ran with {key}={value!r}, not params.yaml's"
        for out in st["outs"]:
            if not out["path"].endswith((".json", ".csv")) or not out["path"].startswith(("metrics/", "plots/")):
                continue
            recorded.add(out["path"])
            digest = hashlib.md5(committed(out["path"])).hexdigest()
            assert digest == out["md5"], f"{out['path']} is not the file dvc.lock records"
    assert recorded == tracked - {"dvc.lock"} and "dvc.lock" in tracked
    assert recorded >= {"metrics/eval.json", "metrics/train.json", *(f"plots/{s}.csv" for s in
                                                                      ("sft", "warmup", "control", "grpo", "accuracy"))}
    metrics = json.loads(committed("metrics/eval.json"))
    assert list(metrics) == list(dict.fromkeys(_value(params, "evaluate.stages")))
    assert {"sft", "control", "warmup", "grpo"} <= set(metrics)
    # the README's "What the default run shows" table is this file
    readme = committed("README.md").decode()
    table = readme[readme.index("## What the default run shows"):].split("\n\n")
    rows = {line.split("|")[1].split()[0]: line for block in table if block.startswith("| checkpoint")
            for line in block.splitlines()[2:]}
    for stage, m in metrics.items():
        cells = [f"{100 * m['arith_accuracy']:.1f}%", f"{100 * m['arith_maj_at_8']:.1f}%",
                 f"{100 * m['gsm8k_accuracy']:.2f}% [{100 * m['gsm8k_accuracy_ci95_low']:.2f}, "
                 f"{100 * m['gsm8k_accuracy_ci95_high']:.2f}]", f"{100 * m['gsm8k_format_rate']:.1f}%"]
        assert all(c in rows[stage] for c in cells), f"README row {stage!r} is not metrics/eval.json's: {cells}"


def test_the_committed_results_check_holds_after_a_run_rewrote_the_workspace(tmp_path, monkeypatch):
    """`make run` on another CPU class rewrites metrics/, plots/ and dvc.lock as DVC does (other figures,
    the lock recording their hashes); the check above is about what is committed, so in such a
    checkout it still passes, and outside a git checkout it skips, saying why."""
    import hashlib

    if subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip(f"{REPO} is not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True, env=DVC_ENV)
    path = clone / "metrics" / "eval.json"
    before = hashlib.md5(path.read_bytes()).hexdigest()
    metrics = json.loads(path.read_text())
    for m in metrics.values():  # the figures of another CPU class's float sums
        m["arith_accuracy"] = round(m["arith_accuracy"] + 0.005, 4)
        m["gsm8k_accuracy"] = round(m["gsm8k_accuracy"] + 0.0008, 6)
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    lock = (clone / "dvc.lock").read_text()
    assert lock.count(before) == 1
    (clone / "dvc.lock").write_text(lock.replace(before, hashlib.md5(path.read_bytes()).hexdigest()))
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout.split() == ["M", "dvc.lock", "M", "metrics/eval.json"]
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "REPO", clone)
    test_the_committed_results_are_those_of_the_committed_params()

    plain = tmp_path / "plain"  # the same files, no git
    shutil.copytree(clone, plain, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(module, "REPO", plain)
    with pytest.raises(pytest.skip.Exception, match="not a git checkout"):
        test_the_committed_results_are_those_of_the_committed_params()


def test_a_gsm8k_source_dvc_cannot_hash_is_one_line_before_any_stage(tmp_path):
    """DVC stops on a missing dependency before prepare starts (`[Errno 2] No such file or directory`), so
    a flow run's copy checks the configured source first: a path, relative to the copy or absolute, passes;
    a hub id or a missing path is one line naming the key and saying that hub ids are read outside DVC."""
    from flows.experiment import apply_overrides, check_gsm8k_source
    from pipeline.core.errors import InputError

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    (tmp_path / "datasets" / "gsm8k").mkdir(parents=True)
    check_gsm8k_source(tmp_path)  # the default, ./datasets/gsm8k of the copy
    for source in ("openai/gsm8k", str(tmp_path / "missing")):
        apply_overrides(params, [f"data.gsm8k_source={source}"])
        with pytest.raises(InputError, match=rf"^data.gsm8k_source = {re.escape(repr(source))}: no such file or "
                                             r"folder; .*a hub id is read only outside DVC \(python -m pipeline all"):
            check_gsm8k_source(tmp_path)
    apply_overrides(params, [f"data.gsm8k_source={GSM8K}"])
    check_gsm8k_source(tmp_path)


def test_dvc_config_has_analytics_off_and_ignores_bytecode():
    assert "analytics = false" in (REPO / ".dvc" / "config").read_text()
    assert "__pycache__/" in (REPO / ".dvcignore").read_text()


@pytest.mark.slow
def test_repro_prepare_then_nothing_to_do(tmp_path):
    """Default suite: DVC runs the real prepare stage, records it, and a second repro is a no-op."""
    repo = copy_repo(tmp_path / "repo")
    first = sh(repo, "dvc", "repro", "prepare")
    assert ran(first) == ["prepare"]
    assert (repo / "data" / "tokenizer.json").is_file() and (repo / "dvc.lock").is_file()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["prepare"]
    assert set(lock["params"]["params.yaml"]) == {"data", "model.backend", "model.init", "tasks"}
    # importing the pipeline writes bytecode next to the code deps: it must not invalidate the stage
    subprocess.run([sys.executable, "-c", "import pipeline.stages.prepare"], cwd=repo, env=DVC_ENV, check=True)
    second = sh(repo, "dvc", "repro", "prepare")
    assert ran(second) == [] and "up to date" in second.stdout
    assert "changed" not in sh(repo, "dvc", "status", "prepare").stdout


@pytest.mark.slow
def test_prepare_depends_on_the_configured_gsm8k_source(tmp_path):
    """prepare's GSM8K dependency is the configured `data.gsm8k_source` (dvc.yaml templates it from
    params.yaml), not the committed datasets/gsm8k: removing 10 of the 80 train rows of the configured
    copy makes prepare stale, and the lock records that copy."""
    from flows.experiment import apply_overrides

    source = tmp_path / "gsm8k"
    shutil.copytree(GSM8K, source)
    repo = copy_repo(tmp_path / "repo")
    apply_overrides(repo / "params.yaml", [f"data.gsm8k_source={source}"])
    sh(repo, "git", "commit", "-qam", "GSM8K from a copy outside the repo")
    assert ran(sh(repo, "dvc", "repro", "prepare")) == ["prepare"]
    assert "changed" not in sh(repo, "dvc", "status", "prepare").stdout

    train = source / "train.jsonl"
    rows = train.read_text().splitlines(keepends=True)
    assert len(rows) == 80
    train.write_text("".join(rows[:70]))
    status = sh(repo, "dvc", "status", "prepare").stdout
    assert "changed deps" in status and f"modified:           {source}" in status, status
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["prepare"]
    assert str(source) in [d["path"] for d in lock["deps"]] and "datasets/gsm8k" not in str(lock["deps"])


# --------------------------------------------------------------------------- whole pipeline (~2 min; in CI)

@pytest.mark.slow
def test_full_pipeline_repro_experiments_diffs_and_remote(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    first = sh(repo, "dvc", "repro")
    assert ran(first) == list(STAGES)
    assert output_files(repo) == smoke_outputs()  # the same files in the same places as the flow run
    assert sh(repo, "dvc", "repro").stdout.count("Running stage") == 0
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "baseline run")

    # a grpo param: only grpo and evaluate re-run
    # (on smoke params every reward is 0, so kl_coef or lr would leave grpo's outputs bit-identical and
    # DVC would rightly skip evaluate; the iteration count changes them)
    exp = sh(repo, "dvc", "exp", "run", "-S", "grpo.iterations=3")
    assert ran(exp) == ["grpo", "evaluate"]
    show = sh(repo, "dvc", "exp", "show", "--no-pager", "--csv").stdout
    assert "grpo.iterations" in show and "metrics/train.json" in show
    metrics = sh(repo, "dvc", "metrics", "diff", "--all", "--json").stdout
    assert "metrics/eval.json" in metrics and '"grpo.iterations"' in metrics  # train.json ranks the runs
    plots_dir = tmp_path / "plots_html"
    sh(repo, "dvc", "plots", "diff", "-o", str(plots_dir))
    assert (plots_dir / "index.html").is_file()

    # a local remote: push, then pull into a second clone
    remote = tmp_path / "remote"
    sh(repo, "dvc", "remote", "add", "-d", "local", str(remote))
    sh(repo, "dvc", "push")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "kl 0.02 + remote")
    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", str(repo), str(clone))
    sh(clone, "dvc", "pull", "dvc.yaml")  # the default pipeline's outputs: the recipe never ran here
    assert output_files(clone) == output_files(repo)
    assert (clone / "checkpoints" / "grpo" / "model.safetensors").is_file()
    status = sh(clone, "dvc", "status", "dvc.yaml")
    assert "up to date" in status.stdout, status.stdout


RECIPE = "recipes/smollm2"


def recipe_row_cells(m: dict) -> list[str]:
    """What the README's recipe table shows of one eval.json entry: held-out arithmetic with its interval,
    per level, well-formed rate, GSM8K with its interval."""
    pct = lambda key: f"{100 * m[key]:.1f}"  # noqa: E731
    cells = [f"{pct('arith_accuracy')}% [{pct('arith_accuracy_ci95_low')}, {pct('arith_accuracy_ci95_high')}]"]
    cells += [f"{pct(f'arith_level{lv}_accuracy')}%" for lv in (1, 2, 3)]
    cells += [f"{pct('arith_format_rate')}%",
              f"{pct('gsm8k_accuracy')}% [{pct('gsm8k_accuracy_ci95_low')}, {pct('gsm8k_accuracy_ci95_high')}]",
              f"{pct('gsm8k_format_rate')}%", f"{pct('gsm8k_truncation_rate')}%"]
    return cells


def test_the_recipes_committed_results_are_those_of_its_params():
    """recipes/smollm2 as committed: its dvc.lock has every stage of its dvc.yaml, each run with its
    params.yaml's values; the metric and plot files it records are the committed ones (md5); eval.json
    scores the base model zero-shot and few-shot and every trained checkpoint; and the README's recipe
    table is that file. Read from git HEAD, like the default run's check."""
    import hashlib

    from ruamel.yaml import YAML

    yaml12 = YAML(typ="safe")
    lock = yaml12.load(committed(f"{RECIPE}/dvc.lock"))["stages"]
    assert set(lock) == set(yaml.safe_load(committed(f"{RECIPE}/dvc.yaml"))["stages"])
    params = yaml12.load(committed(f"{RECIPE}/params.yaml"))
    for name, st in lock.items():
        for key, value in st.get("params", {}).get("params.yaml", {}).items():
            assert _value(params, key) == value, f"{RECIPE}/dvc.lock: stage {name} ran with {key}={value!r}"
        for out in st["outs"]:
            if out["path"].startswith(("metrics/", "plots/")) and out["path"].endswith((".json", ".csv")):
                digest = hashlib.md5(committed(f"{RECIPE}/{out['path']}")).hexdigest()
                assert digest == out["md5"], f"{RECIPE}/{out['path']} is not the file dvc.lock records"
    metrics = json.loads(committed(f"{RECIPE}/metrics/eval.json"))
    assert list(metrics) == ["sft", "sft_fewshot", "warmup", "grpo"]
    readme = committed("README.md").decode()
    section = readme[readme.index("## A real pretrained model"):].split("\n## ")[0]
    rows = {line.split("|")[1].strip().split()[0].strip("`"): line for line in section.splitlines()
            if line.startswith("| `")}
    for entry, m in metrics.items():
        cells = recipe_row_cells(m)
        assert all(c in rows[entry] for c in cells), f"README recipe row {entry!r} is not eval.json's: {cells}"
    # the LoRA row is the LoRA experiment's files, kept beside the recipe
    lora = json.loads(committed(f"{RECIPE}/results/lora-r16/metrics/eval.json"))["warmup"]
    (row,) = [line for line in section.splitlines() if line.startswith("| LoRA `warmup`")]
    assert all(c in row for c in recipe_row_cells(lora)), f"README LoRA row is not lora-r16's eval.json: {row}"


@pytest.mark.slow
def test_dvc_plots_draws_the_named_plots_only():
    """`dvc plots show` draws the top-level plots (one per signal, warmup and grpo as two lines) and the
    PNGs, not a raw plot per CSV: the series are outs (`cache: false`), not stage-level `plots:`."""
    import yaml

    for path in (REPO / "dvc.yaml", REPO / "recipes" / "smollm2" / "dvc.yaml"):
        spec = yaml.safe_load(path.read_text())
        assert not [s for s, st in spec["stages"].items() if "plots" in st], path
        named = [next(iter(p)) if isinstance(p, dict) else p for p in spec["plots"]]
        assert "reward" in named and "accuracy" in named
    res = subprocess.run([str(Path(sys.executable).parent / "dvc"), "plots", "show", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    ids = json.loads(res.stdout)["data"]
    assert not [i for i in ids if i.endswith(".csv")], list(ids)
    assert {"reward", "kl", "accuracy"} <= {i.split("::")[-1] for i in ids}
