"""A user's verifier named `module:function` in grpo.reward / evaluate.reward: imported by name
(never evaluated), checked at stage start, its scores used by training and evaluation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError
from pipeline.config_loading import load_config
from pipeline.errors import InputError
from pipeline.rewards.verifiers import load_verifier, rewards_by_source, score

ROOT = Path(__file__).resolve().parents[1]

USER_MODULE = '''
def exact(completion, gold):
    """1 when the completion is exactly the gold text (a non-numeric dataset)."""
    return float(completion.strip() == str(gold))

def words(completion, gold):
    return "many"

not_a_function = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def test_user_verifier_replaces_the_builtin_for_every_source(user_module):
    by_source = rewards_by_source(f"{user_module}:exact", "grpo.reward")
    assert by_source("gsm8k")(" Paris ", "Paris") == 1.0 and by_source("arith")("<answer>3</answer>", 3) == 0.0
    assert rewards_by_source("", "grpo.reward")("gsm8k")("<answer>3</answer>", 3.0) == 1.2  # the built-in


def test_evaluation_counts_a_user_score_of_one_as_correct(user_module):
    from pipeline.evaluation import score_completion

    v = load_verifier(f"{user_module}:exact", "evaluate.reward")
    assert score_completion("Paris", "Paris", "gsm8k", v)["correct"] is True
    assert score_completion("Rome", "Paris", "gsm8k", v) == {**score_completion("Rome", "Paris", "gsm8k", v),
                                                              "correct": False, "reward": 0.0}
    assert score("<answer>4</answer>", 4.0, "gsm8k") == 1.2


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("{mod}:missing", "has no function 'missing'"),
    ("{mod}:not_a_function", "has no function 'not_a_function'"),
])
def test_bad_specs_name_the_key(user_module, spec, message):
    with pytest.raises(InputError, match=message) as exc:
        load_verifier(spec.format(mod=user_module), "grpo.reward")
    assert str(exc.value).startswith("grpo.reward = ")


def test_a_non_numeric_score_is_refused(user_module):
    v = load_verifier(f"{user_module}:words", "grpo.reward")
    with pytest.raises(InputError, match="returned 'many'; a verifier returns a finite number"):
        v("x", 1.0)


@pytest.mark.parametrize("spec", ["os.system('x')", "a b:c", "mod.:f", ":f", "mod:f()"])
def test_config_accepts_only_module_colon_function(spec):
    with pytest.raises(ConfigError, match="grpo.reward .*module:function"):
        load_config(ROOT / "configs" / "smoke.yaml", [f"grpo.reward={spec}"])


def test_cli_fails_fast_with_one_line_for_an_unimportable_verifier(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "grpo", "--params", str(ROOT / "configs" / "smoke.yaml"),
                           "--set", "grpo.reward=no_such_module_xyz:score"], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "grpo.reward = 'no_such_module_xyz:score'" in proc.stderr
