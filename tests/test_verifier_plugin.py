"""A user's verifier named `module:function` in grpo.reward / evaluate.reward: found under
pipeline/rewards/ (a DVC dep), read before it is imported, imported by name (never evaluated) once,
checked at stage start, its scores used by training and evaluation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import ConfigError
from pipeline.core.config_loading import load_config
from pipeline.core.errors import InputError
from pipeline.rewards import verifiers
from pipeline.rewards.verifiers import load_verifier, rewards_by_source, score

ROOT = Path(__file__).resolve().parents[1]

USER_MODULE = '''
def exact(completion, gold):
    """1 when the completion is exactly the gold text (a non-numeric dataset)."""
    return float(completion.strip() == str(gold))

def words(completion, gold):
    return "many"

def boom(completion, gold):
    if "<answer>" in completion and gold != 4.0:
        raise KeyError("no such row")
    return 0.0

def one_argument(completion):
    return 0.0

not_a_function = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module in a folder that stands for pipeline/rewards/ (the plug-in root), on sys.path."""
    name = f"my_rewards_mod_{tmp_path.name[-12:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(verifiers, "PLUGIN_ROOT", tmp_path.resolve())
    verifiers._load.cache_clear()
    yield name
    verifiers._load.cache_clear()
    sys.modules.pop(name, None)


def test_user_verifier_replaces_the_builtin_for_every_source(user_module):
    by_source = rewards_by_source(f"{user_module}:exact", "grpo.reward")
    assert by_source("gsm8k")(" Paris ", "Paris") == 1.0 and by_source("arith")("<answer>3</answer>", 3) == 0.0
    assert rewards_by_source("", "grpo.reward")("gsm8k")("<answer>3</answer>", 3.0) == 1.2  # the built-in


def test_evaluation_counts_a_user_score_of_one_as_correct(user_module):
    from pipeline.rl.evaluation import score_completion

    v = load_verifier(f"{user_module}:exact", "evaluate.reward")
    assert score_completion("Paris", "Paris", "gsm8k", v)["correct"] is True
    assert score_completion("Rome", "Paris", "gsm8k", v) == {**score_completion("Rome", "Paris", "gsm8k", v),
                                                              "correct": False, "reward": 0.0}
    assert score("<answer>4</answer>", 4.0, "gsm8k") == 1.2


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_xyz:f", "no module 'no_such_module_xyz' to import"),
    ("{mod}:missing", "defines no top-level `def missing(completion, gold)`"),
    ("{mod}:not_a_function", "defines no top-level `def not_a_function(completion, gold)`"),
    ("{mod}:one_argument", "defines no top-level `def one_argument(completion, gold)`"),
    ("os:system", "outside pipeline/rewards/"),
    ("pipeline.rl.masked:set_seed", "outside pipeline/rewards/"),
])
def test_bad_specs_name_the_key(user_module, spec, message):
    with pytest.raises(InputError, match=re.escape(message)) as exc:
        load_verifier(spec.format(mod=user_module), "grpo.reward")
    assert str(exc.value).startswith("grpo.reward = ") and "\n" not in str(exc.value)


def test_a_module_is_read_not_imported_until_its_function_is_found(tmp_path, monkeypatch):
    """A module-level side effect never runs for a spec whose function the file does not define."""
    (tmp_path / "side_effect_mod.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').close()\n\ndef score(completion, gold):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(verifiers, "PLUGIN_ROOT", tmp_path.resolve())
    with pytest.raises(InputError, match="defines no top-level"):
        verifiers.UserVerifier("side_effect_mod:system", "grpo.reward")
    assert not (tmp_path / "ran").exists() and "side_effect_mod" not in sys.modules
    verifiers.UserVerifier("side_effect_mod:score", "grpo.reward")
    assert (tmp_path / "ran").exists()
    sys.modules.pop("side_effect_mod", None)


def test_it_is_checked_and_imported_once_per_process(user_module):
    assert load_verifier(f"{user_module}:exact", "evaluate.reward") is load_verifier(f"{user_module}:exact",
                                                                                      "evaluate.reward")


def test_a_verifier_that_raises_is_one_line_naming_the_key(user_module):
    v = load_verifier(f"{user_module}:boom", "grpo.reward")  # passes the probe (gold 4)
    with pytest.raises(InputError, match=r"^grpo.reward = '.*:boom' raised KeyError: 'no such row' \(on completion "
                                         r"'<answer>1</answer>', gold 2.0\)$"):
        v("<answer>1</answer>", 2.0)


def test_the_example_plugin_scores_and_lives_where_dvc_tracks_it():
    v = load_verifier("pipeline.rewards.plugins.example:last_integer", "grpo.reward")
    assert v("so the answer is 18", 18.0) == 1.0 and v("so 18, no 19", 18) == 0.0 and v("none", 3) == 0.0
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in ("warmup", "grpo", "evaluate"):
        assert "pipeline/rewards" in stages[name]["deps"], name
    recipe = yaml.safe_load((ROOT / "recipes" / "smollm2" / "dvc.yaml").read_text())["stages"]
    for name in ("warmup", "grpo", "evaluate"):
        assert any(str(d).endswith("pipeline/rewards") for d in recipe[name]["deps"]), name


def test_a_non_numeric_score_is_refused_at_start(user_module):
    with pytest.raises(InputError, match="returned 'many'; a verifier returns a finite number"):
        load_verifier(f"{user_module}:words", "grpo.reward")


@pytest.mark.parametrize("spec", ["os.system('x')", "a b:c", "mod.:f", ":f", "mod:f()"])
def test_config_accepts_only_module_colon_function(spec):
    with pytest.raises(ConfigError, match="grpo.reward .*module:function"):
        load_config(ROOT / "configs" / "smoke.yaml", [f'grpo.reward="{spec}"'])  # quoted: DVC's -S grammar


@pytest.mark.parametrize("spec", ["no_such_module_xyz:score", "os:system"])
@pytest.mark.slow
def test_cli_fails_fast_with_one_line_for_a_bad_verifier(tmp_path, spec):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "grpo", "--params", str(ROOT / "configs" / "smoke.yaml"),
                           "--set", f"grpo.reward={spec}"], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and f"grpo.reward = '{spec}'" in proc.stderr
