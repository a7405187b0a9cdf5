"""What the tests share: small real fakes (a tiny BPE tokenizer, tiny policies of every backend),
the committed GSM8K fixture, and a temporary copy of the repository for DVC/Prefect runs.

Nothing here downloads: GSM8K comes from tests/fixtures/gsm8k, HF models are built from a config
and saved to a temporary folder. Test modules import these helpers from here, never from each other.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# 80 train and 30 test rows of GSM8K (MIT; LICENSE beside them): every test that needs GSM8K reads these
GSM8K = REPO / "tests" / "fixtures" / "gsm8k"
QUIET_ENV = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost", "GIT_COMMITTER_NAME": "test",
           "GIT_COMMITTER_EMAIL": "test@localhost"}
os.environ.update(QUIET_ENV)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tests that start a real server (Prefect's test harness or API server, an MLflow server) by
# requesting one of these fixtures are marked `integration` and `slow` here, wherever they live.
SERVER_FIXTURES = {"harness", "prefect_server", "mlflow_server"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """One torch thread: the tests' tensors are tiny, and on a small shared machine intra-op
    threads spin against other processes (a 10x slowdown under load, for no gain when idle)."""
    import torch

    torch.set_num_threads(1)


# prompts of three lengths (left padding in every batch) for the rollout tests
ROLLOUT_PROMPTS = ["Question: What is 3 + 4?\nAnswer:", "Question: 12 - 5?", "Question: What is 99 + 1?\nAnswer: 9"]


def seeded(seed: int = 0):
    """A CPU torch.Generator with this seed."""
    import torch

    return torch.Generator().manual_seed(seed)


def arithmetic_texts(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        texts.append(f"Question: What is {a} {op} {b}?\nAnswer: {a} {op} {b} = "
                     f"<answer>{a + b if op == '+' else a - b}</answer><|endoftext|>")
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE (vocab 320) trained on a few hundred arithmetic strings."""
    from pipeline.data.tokenizer import train_tokenizer

    return train_tokenizer(arithmetic_texts(), vocab_size=320)


def tiny_model_config(**overrides):
    from pipeline.core.config import ModelConfig

    base = dict(backend="gpt", n_layer=2, n_head=2, n_embd=32, block_size=128, device="cpu")
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture
def gpt_policy(tiny_tokenizer):
    """A 2-layer, 32-wide from-scratch GPT policy with rope (random init, seeded)."""
    import torch

    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    return build_policy(tiny_model_config(), tiny_tokenizer)


# A ChatML-style template (Qwen's layout) whose end-of-turn is the tokenizer's eos token.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_hf(folder, kind: str, tokenizer, chat_template: str | None = None, max_positions: int = 128) -> str:
    """Build a tiny GPT-2, Llama or Qwen2 (GQA: 4 query heads, 2 key/value heads) from a config and save
    it with a HF tokenizer (with `chat_template` if given); return the folder."""
    import torch
    from tokenizers import Tokenizer
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                              Qwen2Config, Qwen2ForCausalLM)

    from pipeline.data.tokenizer import EOS, PAD

    torch.manual_seed(0)
    V = tokenizer.vocab_size
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=max_positions, n_embd=32, n_layer=2, n_head=2,
                         bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                          bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":  # q/k/v biases, untied head
        cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                          tie_word_embeddings=False, use_sliding_window=False,
                          bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        model = Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),
                                     pad_token=PAD, eos_token=EOS)
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory, tiny_tokenizer):
    """{'gpt2', 'llama', 'qwen2': folder} of tiny saved HF models (Llama and Qwen2 with a chat template)."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny_hf(root / kind, kind, tiny_tokenizer, None if kind == "gpt2" else CHAT_TEMPLATE)
            for kind in ("gpt2", "llama", "qwen2")}


@pytest.fixture(params=["gpt", "gpt-learned", "hf-gpt2", "hf-llama"])
def any_policy(request, tiny_tokenizer, hf_dirs):
    """The same tests over every backend: GPT (rope, learned) and HF (GPT-2, Llama)."""
    import torch

    from pipeline.model.policy import build_policy

    torch.manual_seed(0)
    if request.param == "gpt":
        return build_policy(tiny_model_config(), tiny_tokenizer)
    if request.param == "gpt-learned":
        return build_policy(tiny_model_config(positions="learned"), tiny_tokenizer)
    kind = request.param.split("-")[1]
    return build_policy(tiny_model_config(backend="hf", init=hf_dirs[kind]))


# --------------------------------------------------------------------------- a copy of the repo for DVC / Prefect

PIPELINE_OUTPUTS = ("data/", "checkpoints/", "metrics/", "plots/", "reports/", "dvc.lock", "mlflow.db", "mlruns/")


def _git_files(*args: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def copy_repo(dst: Path, git: bool = True) -> Path:
    """The repo's files as a clone would have them, without .ci/ and tests/, copied into `dst`, with
    the smoke config written out in full as params.yaml and GSM8K read from the fixture; with `git`,
    `dst` becomes a fresh git repo of one commit. Untracked files come too (new code not yet added).
    The recipes come as a clone has them (their dvc.yaml, params, lock and committed results, none of
    the outputs a recipe run leaves, such as its downloaded model): DVC sees every dvc.yaml of the
    project, so a copy without them would hide what a user's clone meets. The default pipeline's
    outputs never come: neither what a `make run` in this checkout wrote nor its committed results
    (metrics, plot series, dvc.lock), which belong to params.yaml, not the smoke config."""
    for rel in _git_files("-c") + _git_files("-o", "--exclude-standard"):
        src = REPO / rel
        if src.is_file() and not rel.startswith((".ci/", "tests/", *PIPELINE_OUTPUTS)):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    # written out in full: DVC tracks (and `dvc exp run -S` can set) only keys present in the file
    from pipeline.core.config_loading import dump_config, load_config

    smoke = load_config(REPO / "configs" / "smoke.yaml", [f"data.gsm8k_source={GSM8K}"])
    (dst / "params.yaml").write_text(dump_config(smoke))
    if git:
        env = {**os.environ, **GIT_ENV}
        for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
            subprocess.run(cmd, cwd=dst, check=True, env=env)
    return dst


def output_files(root: Path) -> set[str]:
    """Pipeline outputs (relative paths), the set a flow run and `dvc repro` must agree on."""
    out = set()
    for top in ("data", "checkpoints", "metrics", "plots", "reports"):
        out |= {str(p.relative_to(root)) for p in (root / top).rglob("*") if p.is_file()} if (root / top).exists() else set()
    return {p for p in out if ".resume" not in p and not p.endswith(".gitignore")}


def smoke_outputs() -> set[str]:
    """Every file the smoke pipeline writes (docs/architecture.md), whichever orchestrator runs it."""
    files = {f"data/{n}" for n in ("gsm8k_train.jsonl", "gsm8k_val.jsonl", "gsm8k_test.jsonl", "arith_train.jsonl",
                                   "arith_eval.jsonl", "tokenizer.json", "stats.json")}
    files |= {f"checkpoints/{s}/{n}" for s in ("sft", "warmup", "control", "grpo")
              for n in ("config.json", "manifest.json", "model.safetensors", "state.json", "tokenizer.json")}
    files |= {f"plots/{n}" for n in ("sft.csv", "warmup.csv", "control.csv", "grpo.csv", "accuracy.csv",
                                     "accuracy.png", "training_curves.png")}
    files |= {f"reports/predictions_{s}_{t}.csv" for s in ("sft", "control", "warmup", "grpo")
              for t in ("gsm8k", "arith")}
    return files | {"metrics/eval.json", "metrics/train.json", "data/tasks/index.json"}


def task_runs_of(flow_run_id, expect=(), timeout: float = 60.0):
    """The flow run's task runs, once the API holds a final state for each (and a run of every task
    named in `expect`): task-run states reach the API as events, so right after the flow returns a
    run can still be missing, or its state None or not final."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            names = {r.name.rsplit("-", 1)[0] for r in runs}  # task run names are "<task>-<n>"
            settled = all(r.state is not None and r.state.is_final() for r in runs) and set(expect) <= names
            if settled or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


# --------------------------------------------------------------------------- DVC and git in a copy of the repo

def sh(cwd, *args) -> str:
    """`dvc ...` through this interpreter, or git; fails the test with the output on a non-zero exit."""
    cmd = [sys.executable, "-m", "dvc", *args[1:]] if args[0] == "dvc" else list(args)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **GIT_ENV}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=900)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout


def experiment(repo: Path, name: str) -> dict:
    """The `data` of experiment `name` as `dvc exp show --json` lists it (params, metrics)."""
    shown = json.loads(sh(repo, "dvc", "exp", "show", "--json"))
    revs = [r for row in shown for e in (row.get("experiments") or []) for r in e["revs"]]
    [mine] = [r for r in revs if r.get("name") == name]
    return mine["data"]


def tracked_repo(tmp_path: Path, experiment: str) -> Path:
    """A git copy of the repo on smoke params with tracking on (the repo's own mlflow.db)."""
    from flows.experiment import apply_overrides

    repo = copy_repo(tmp_path / "repo")
    apply_overrides(repo / "params.yaml", ["tracking.enabled=true", f"tracking.experiment={experiment}"])
    sh(repo, "git", "commit", "-qam", "tracking on")
    return repo


# --------------------------------------------------------------------------- GSM8K-shaped records

TEMPLATE = "Q: {question}\nA:"

GOOD = [  # well-formed GSM8K records: a worked answer, thousands separators, a negative, a decimal
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A farm has 1,000 hens and buys 234 more. How many hens?",
     "answer": "1,000 + 234 = <<1000+234=1234>>1,234\n#### 1,234"},
    {"question": "It is 2 degrees and drops 5. What is the temperature {in C}?",
     "answer": "2 - 5 = <<2-5=-3>>-3\n#### -3"},
    {"question": "Half of 7?", "answer": "7 / 2 = <<7/2=3.5>>3.5\n####3.5"},
]

# the same records asked as other questions: a test split disjoint from a train split of GOOD
GOOD_TEST = [{**r, "question": f"In the test split: {r['question']}"} for r in GOOD]


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# --------------------------------------------------------------------------- the GRPO stages' working directory

def smoke_cfg(*overrides: str):
    """configs/smoke.yaml on the GSM8K fixture, with `section.key=value` overrides."""
    from pipeline.core.config_loading import load_config

    return load_config(REPO / "configs" / "smoke.yaml", [f"data.gsm8k_source={GSM8K}", *overrides])


def weights(folder: Path) -> dict:
    """Every tensor of the safetensors files in `folder`."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def assert_resumes_bit_identically(module, run, stage: str, monkeypatch, caplog, step: int = 2) -> None:
    """`run()` (a stage of `module`, saving resume states through its `save_resume`) to the end; then again,
    killed right after its first resume state (iteration `step`), and once more: the last run says it
    resumed, and its final weights and series equal the uninterrupted run's, bit for bit (CPU)."""
    import torch

    run()
    whole, series = weights(Path("checkpoints") / stage), (Path("plots") / f"{stage}.csv").read_text()

    class Killed(Exception):
        pass

    real = module.save_resume

    def save_then_die(*a, **k):
        real(*a, **k)
        raise Killed

    monkeypatch.setattr(module, "save_resume", save_then_die)
    with pytest.raises(Killed):
        run()
    monkeypatch.setattr(module, "save_resume", real)
    with caplog.at_level("INFO", logger="pipeline"):
        run()
    assert f"resuming from checkpoints/{stage}.resume/step_{step:06d}" in caplog.text
    again = weights(Path("checkpoints") / stage)
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert (Path("plots") / f"{stage}.csv").read_text() == series


@pytest.fixture(scope="session")
def grpo_prepared(tmp_path_factory):
    """A working directory with prepared data (smoke params) and two different random tiny policies
    saved as the SFT and warmup checkpoints."""
    import torch

    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.stages.prepare import run_prepare
    from pipeline.train.checkpoint import save_policy

    work = tmp_path_factory.mktemp("train")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        cfg = smoke_cfg()
        run_prepare(cfg)
        torch.manual_seed(0)
        policy = build_policy(cfg.model, load_tokenizer(work / "data" / "tokenizer.json"))
        save_policy(work / "checkpoints" / "sft", policy)
        # a warmup checkpoint that differs from the reference: in the grpo stage the KL term then
        # moves the weights on every step, whatever the rewards, so resume exactness is observable
        torch.manual_seed(1)
        save_policy(work / "checkpoints" / "warmup", build_policy(cfg.model, load_tokenizer(work / "data" / "tokenizer.json")))
    finally:
        os.chdir(cwd)
    return work


@pytest.fixture
def grpo_workdir(grpo_prepared, tmp_path, monkeypatch):
    """A private copy of the prepared directory as the working directory."""
    dst = tmp_path / "w"
    shutil.copytree(grpo_prepared, dst)
    monkeypatch.chdir(dst)
    return dst


def kill_tree_at(cmd: list[str], cwd: Path, env: dict, marker: Path, timeout: float = 240) -> None:
    """Start `cmd`, wait until the file or folder `marker` exists (a resume state), then SIGKILL the process
    and every descendant (a torchrun launcher's ranks run outside the caller's process group)."""
    psutil = pytest.importorskip("psutil")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be killed: {proc.stdout.read()}")
        time.sleep(0.02)
    tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    proc.wait()


def reward_of(fn):
    """A number task's rewards with one part, `fn(completion, gold) -> float` per completion (a stand-in
    reward with variance for a random policy), called through the TRL signature a user's function has."""
    from pipeline.rewards.task_rewards import Checker, TaskRewards

    def part(prompts, completions, gold, **columns):
        return [fn(c, g) for c, g in zip(completions, gold)]

    return TaskRewards("stand_in", Checker("number"), ["stand_in"], [1.0], {"stand_in": part})
