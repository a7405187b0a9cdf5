"""A task of your own: params alone (a `tasks` entry, `grpo.task`, `evaluate.tasks`), a JSONL with its own
column names, a reward function in your own module. What is tested: the answer types and the weighted
reward by hand, each bad input as one line naming the file, row, column, key or function, and (slow) the
whole shape through `dvc repro` and the Prefect flow on a copy of the repository, with nothing added to
pipeline/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import GSM8K, QUIET_ENV, REPO, copy_repo, sh, write_jsonl

MINE = {"source": "data_in/mine", "fields": {"question": "q", "answer": "ans"}, "answer": "number",
        "rewards": ["correct", "format", "mine_rewards:brevity"], "reward_weights": [1.0, 0.2, 0.1]}
REWARD_MODULE = '''
def brevity(prompts, completions, q, ans, **columns):
    """Minus a tenth per 100 characters; it checks that it sees the prompts and the row's columns."""
    assert len(prompts) == len(completions) == len(q) == len(ans), "misaligned"
    assert all("Question:" in p for p in prompts), "no prompts"
    return [-len(c) / 100 for c in completions]
'''


def _records(n: int, start: int = 0) -> list[dict]:
    return [{"q": f"Sam has {i} apples and buys {i + 3} more. How many apples now?", "ans": 2 * i + 3, "level": "easy"}
            for i in range(start, start + n)]


def _cfg(tmp_path: Path, monkeypatch, **task):
    from pipeline.core.config_loading import config_from_dict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data_in").mkdir(exist_ok=True)
    return config_from_dict({"tasks": {"mine": {**MINE, **task}}, "grpo": {"task": "mine"},
                             "evaluate": {"tasks": ["mine"]}}, "params.yaml")


# --------------------------------------------------------------------------- answers and rewards, by hand

def test_answer_types_read_and_check_by_hand():
    from pipeline.rewards.task_rewards import Checker

    text, choice, expr = Checker("text"), Checker("choice"), Checker("expression")
    assert text.correct("so <answer> Paris. </answer>", {"gold": "paris"})
    assert not text.correct("<answer>Lyon</answer>", {"gold": "Paris"}) and not text.correct("Paris", {"gold": "Paris"})
    assert choice.correct("<answer>(b)</answer>", {"gold": "B"}) and not choice.correct("<answer>C</answer>", {"gold": "B"})
    assert choice.well_formed("<answer>B.</answer>") and not choice.well_formed("<answer>B or C</answer>")
    row = {"gold": 24, "numbers": [2, 3, 4]}
    assert expr.correct("<answer>(2 + 4) * 4 - 0</answer>", row) is False  # a number not given
    assert expr.correct("<answer>2 * 3 * 4</answer>", row) and not expr.correct("<answer>2 * 3 + 4</answer>", row)
    assert Checker("number").correct("<answer>1,234</answer>", {"gold": 1234.0})


def test_the_reward_is_the_weighted_sum_and_each_part_is_kept():
    from pipeline.rewards.task_rewards import Checker, TaskRewards

    seen = {}

    def brevity(prompts, completions, q, **columns):
        seen.update(prompts=prompts, q=q, columns=sorted(columns))
        return [-len(c) / 100 for c in completions]

    rewards = TaskRewards("mine", Checker("number"), ["correct", "format", "brevity"], [1.0, 0.2, 0.1],
                          {"brevity": brevity})
    rows = [{"prompt": "P1", "gold": 5.0, "columns": {"q": "Q1", "ans": 5, "level": "easy"}},
            {"prompt": "P2", "gold": 7.0, "columns": {"q": "Q2", "ans": 7, "level": "hard"}}]
    texts = ["<answer>5</answer>", "it is 8"]  # 18 and 7 characters
    total, parts = rewards.score(["P1", "P2"], texts, rows)
    assert parts == {"correct": [1.0, 0.0], "format": [1.0, 0.0], "brevity": [-0.18, -0.07]}
    assert total == pytest.approx([1.0 + 0.2 - 0.018, -0.007])
    assert seen == {"prompts": ["P1", "P2"], "q": ["Q1", "Q2"], "columns": ["ans", "level"]}


def test_the_built_in_tasks_reward_is_the_chapters_one_to_the_bit():
    """gsm8k and arith: correct 1.0 + well-formed 0.2, the same floats as the reference verifier."""
    from pipeline.rewards.task_rewards import NUMBER_REWARDS
    from pipeline.rewards.verifiers import reward_gsm8k

    texts = ["<answer>4</answer>", "4", "<answer>5</answer>", "<answer>4</answer><answer>4</answer>", ""]
    total, _ = NUMBER_REWARDS.score([""] * 5, texts, [{"gold": 4.0}] * 5)
    assert total == [reward_gsm8k(t, 4.0) for t in texts]


def test_no_built_in_prompt_holds_an_answer_a_model_could_copy():
    from pipeline.core.config import DEFAULT_TEMPLATE
    from pipeline.data.tasks import COUNTDOWN_TEMPLATE
    from pipeline.rewards.parsing import answer_block, extract_exact

    for template in (DEFAULT_TEMPLATE, COUNTDOWN_TEMPLATE):
        copied = template.replace("{question}", "")
        assert answer_block(copied) is None and extract_exact(copied) is None


# --------------------------------------------------------------------------- the rows of a task of yours

def test_a_jsonl_with_its_own_columns_and_plain_numbers_is_read(tmp_path, monkeypatch):
    from pipeline.data.tasks import user_task_splits

    write_jsonl(tmp_path / "data_in/mine/train.jsonl", _records(24))
    write_jsonl(tmp_path / "data_in/mine/test.jsonl", _records(6, start=100)[:5] + [{"q": "Q?", "ans": "#### 1,234"}])
    splits = user_task_splits(_cfg(tmp_path, monkeypatch, val_size=4), "mine")
    assert [len(splits[s]) for s in ("train", "val", "test")] == [20, 4, 6]
    row = splits["test"][0]
    assert row["gold"] == 203 and row["columns"] == {"q": row["question"], "ans": 203, "level": "easy"}
    assert "Question: Sam has 100 apples" in row["prompt"] and splits["test"][-1]["gold"] == 1234


def test_one_file_is_split_by_test_fraction(tmp_path, monkeypatch):
    from pipeline.data.tasks import user_task_splits

    write_jsonl(tmp_path / "data_in/mine.jsonl", _records(30))
    splits = user_task_splits(_cfg(tmp_path, monkeypatch, source="data_in/mine.jsonl", test_fraction=0.2), "mine")
    assert [len(splits[s]) for s in ("train", "val", "test")] == [24, 0, 6]


@pytest.mark.parametrize("task, records, message", [
    ({}, [{"question": "x", "ans": 1}], "tasks.mine.fields.question = 'q': no such column in "),
    ({}, [{"q": "x", "ans": "forty-two"}], "train.jsonl:1: column 'ans' = 'forty-two' is not a number"),
    ({"answer": "choice"}, [{"q": "x", "ans": "maybe"}], "'maybe' is not a choice letter"),
    ({"val_size": 20}, None, "tasks.mine.val_size = 20 would leave 4 of 24 train rows to train on"),
])
def test_bad_rows_are_one_line_naming_where(tmp_path, monkeypatch, task, records, message):
    from pipeline.core.errors import InputError
    from pipeline.data.tasks import user_task_splits

    write_jsonl(tmp_path / "data_in/mine/train.jsonl", records or _records(24))
    write_jsonl(tmp_path / "data_in/mine/test.jsonl", _records(4, start=50))
    with pytest.raises(InputError) as err:
        user_task_splits(_cfg(tmp_path, monkeypatch, **task), "mine")
    assert message in str(err.value) and "\n" not in str(err.value)
    if "no such column" in message:
        assert "columns found: question, ans" in str(err.value)


@pytest.mark.parametrize("task, stage, message", [
    ({"reward_weights": [1.0, 0.2]}, {}, "tasks.mine.reward_weights = [1.0, 0.2] is out of range; allowed: one weight per"),
    ({"source": "elsewhere/mine.jsonl"}, {}, "tasks.mine.source = 'elsewhere/mine.jsonl' is out of range; allowed: a path "
                                             "under data_in/"),
    ({"rewards": ["correct", "os system"], "reward_weights": [1, 1]}, {}, "tasks.mine.rewards[1] = 'os system'"),
    ({}, {"grpo": {"task": "nine"}}, "grpo.task = 'nine' is out of range; allowed: a built-in task"),
])
def test_bad_params_are_one_line_naming_the_key(tmp_path, monkeypatch, task, stage, message):
    from pipeline.core.config import ConfigError
    from pipeline.core.config_loading import config_from_dict

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data_in").mkdir()
    raw = {"tasks": {"mine": {**MINE, **task}}, "grpo": {"task": "mine"}, **stage}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, "params.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_built_in_name_is_not_a_task_of_yours(tmp_path, monkeypatch):
    from pipeline.core.config import ConfigError
    from pipeline.core.config_loading import config_from_dict

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="tasks.gsm8k is a built-in task"):
        config_from_dict({"tasks": {"gsm8k": MINE}}, "params.yaml")


@pytest.mark.parametrize("module, spec, message", [
    (None, "os:system", "os is part of Python's standard library"),
    (None, "no_such_pkg.rewards:f", "no module 'no_such_pkg' to import"),
    ("f = 3\n", "mine_bad:f", "mine_bad.f is a int, not a function"),
    ("def f(prompts, completions, **kw):\n    return [1.0]\n", "mine_bad:f", "returned 1 values for 2 completions"),
    ("def f(prompts, completions, **kw):\n    raise KeyError('ans')\n", "mine_bad:f",
     "tasks.mine.rewards: f raised KeyError: 'ans'"),
    ("def f(prompts, completions, **kw):\n    return ['a'] * len(completions)\n", "mine_bad:f",
     "returned 'a'; each value is a finite number or None"),
])
def test_a_bad_reward_function_stops_at_the_first_row(tmp_path, monkeypatch, module, spec, message):
    """Import, type, length and exceptions: checked on the task's first row, before any rollout."""
    from pipeline.core.errors import InputError
    from pipeline.rewards.task_rewards import task_rewards

    if module:
        (tmp_path / "mine_bad.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mine_bad", None)
    cfg = _cfg(tmp_path, monkeypatch, rewards=["correct", spec], reward_weights=[1.0, 1.0])
    row = {"prompt": "Question: q", "gold": 1.0, "columns": {"q": "q", "ans": 1}}
    with pytest.raises(InputError) as err:
        task_rewards(cfg, "mine").probe(row)
    assert message in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- end to end

def _own_task_repo(tmp_path: Path) -> Path:
    """A copy of the repository with the smoke params, a task of one's own (data in data_in/, a reward in a
    module at the top of the copy, outside pipeline/) trained by grpo and scored by evaluate."""
    import yaml

    repo = copy_repo(tmp_path / "repo", git=False)
    write_jsonl(repo / "data_in/mine/train.jsonl", _records(30))
    write_jsonl(repo / "data_in/mine/test.jsonl", _records(8, start=200))
    (repo / "mine_rewards.py").write_text(REWARD_MODULE)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["tasks"] = {"mine": {**MINE, "val_size": 4}}
    params["grpo"]["task"] = "mine"
    params["evaluate"]["tasks"] = ["mine", "arith"]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "mine"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    return repo


def _check_outputs(repo: Path) -> None:
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert {"mine_accuracy", "mine_format_rate", "arith_accuracy"} <= set(metrics["grpo"])
    header = (repo / "plots/grpo.csv").read_text().splitlines()[0].split(",")
    assert header[-3:] == ["reward/correct", "reward/format", "reward/brevity"]
    assert sorted(p.name for p in (repo / "data/tasks").iterdir()) == [
        "index.json", "mine_test.jsonl", "mine_train.jsonl", "mine_val.jsonl"]


@pytest.mark.slow
def test_your_task_through_dvc_repro_and_an_edit_reruns_prepare(tmp_path):
    repo = _own_task_repo(tmp_path)
    before = {p: p.read_bytes() for p in (repo / "pipeline").rglob("*.py")}
    sh(repo, "dvc", "repro")
    _check_outputs(repo)
    assert {p: p.read_bytes() for p in (repo / "pipeline").rglob("*.py")} == before
    write_jsonl(repo / "data_in/mine/train.jsonl", _records(31))  # one row more
    out = sh(repo, "dvc", "repro")
    assert "Running stage 'prepare'" in out and "Running stage 'grpo'" in out
    assert "Running stage 'sft'" not in out and "Running stage 'control'" not in out  # their inputs did not change


@pytest.mark.slow
def test_your_task_through_the_prefect_flow(tmp_path):
    repo = _own_task_repo(tmp_path)
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "flows.grpo_pipeline"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    _check_outputs(repo)


@pytest.mark.slow
def test_countdown_runs_end_to_end_on_the_smoke_config(tmp_path):
    repo = copy_repo(tmp_path / "repo", git=False)
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}
    sets = ["grpo.task=countdown", "evaluate.tasks=[countdown,arith]", "data.countdown_train_size=200",
            "data.countdown_eval_size=10", f"data.gsm8k_source={GSM8K}"]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "all", *[a for s in sets for a in ("--set", s)]],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert metrics["grpo"]["countdown_examples"] == 10
    assert (repo / "reports/predictions_grpo_countdown.csv").is_file()


def test_a_hub_dataset_is_read_with_its_config_revision_and_splits(tmp_path, monkeypatch):
    """The hub path, offline: `datasets.load_dataset` replaced by a fake serving an in-memory DatasetDict."""
    import datasets

    from pipeline.data.tasks import user_task_splits

    calls = []

    def load_dataset(path, name=None, revision=None):
        calls.append((path, name, revision))
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(_records(10)),
                                     "validation": datasets.Dataset.from_list(_records(4, start=50))})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = _cfg(tmp_path, monkeypatch, source="someone/word-problems", config="main", revision="abc123",
               test_split="validation")
    splits = user_task_splits(cfg, "mine")
    assert calls == [("someone/word-problems", "main", "abc123")]
    assert [len(splits[s]) for s in ("train", "val", "test")] == [10, 0, 4]
    assert splits["test"][0]["id"] == "mine-validation-00000"


def test_an_answer_checker_of_your_own_decides_correct(tmp_path, monkeypatch):
    from pipeline.data.tasks import user_task_splits
    from pipeline.rewards.task_rewards import task_rewards

    (tmp_path / "mine_check.py").write_text("def same_set(text, gold):\n"
                                            "    return sorted(text.replace(' ', '').split(',')) == sorted(gold)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "data_in/mine/train.jsonl", [{"q": f"Letters of word {i}?", "ans": ["a", "b"]} for i in range(4)])
    write_jsonl(tmp_path / "data_in/mine/test.jsonl", [{"q": "Letters of ab?", "ans": ["a", "b"]}])
    cfg = _cfg(tmp_path, monkeypatch, answer="mine_check:same_set", rewards=["correct"], reward_weights=[1.0])
    row = user_task_splits(cfg, "mine")["test"][0]
    total, _ = task_rewards(cfg, "mine").score([row["prompt"]] * 2, ["<answer>b, a</answer>", "<answer>a</answer>"],
                                               [row, row])
    assert total == [1.0, 0.0]
