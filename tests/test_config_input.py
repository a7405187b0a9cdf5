"""Params files and overrides a hostile or careless user might give: each is one line, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import ConfigError
from pipeline.core.config_loading import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


@pytest.mark.parametrize("setting", [
    "grpo.lr=.inf", "warmup.lr=.inf", "sft.lr=.inf", "grpo.kl_coef=.inf", "warmup.temperature=.inf",
    "grpo.temperature=.Inf", "sft.weight_decay=.inf", "grpo.weight_decay=.inf", "grpo.grad_clip=.inf",
    "sft.grad_clip=.INF", "grpo.lr=-.inf", "grpo.lr=.nan", "grpo.kl_coef=.NaN", "data.max_bad_fraction=.nan",
    "grpo.clip=.nan", "evaluate.top_p=.nan", "grpo.lr=1e999", "model.n_layer=.inf", "data.seed=.nan",
])
def test_non_finite_numbers_in_a_params_file_are_refused(tmp_path, setting):
    """YAML's .inf / .nan (any case) and an overflowing 1e999, written in a params file."""
    key, value = setting.split("=")
    section, name = key.split(".")
    raw = yaml.safe_load(SMOKE.read_text())
    raw.setdefault(section, {})[name] = "VALUE"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw).replace("VALUE", value))
    with pytest.raises(ConfigError, match=rf"{key} = .* expected a finite number") as info:
        load_config(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override", ["grpo.lr=inf", "grpo.lr=-inf", "grpo.lr=nan", "grpo.lr=1e999", "sft.lr=inf",
                                      "model.n_layer=inf", "data.seed=nan"])
def test_non_finite_overrides_are_refused(override):
    """The same values as `--set` gives them (DVC's -S grammar: inf, nan)."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key} = .* expected a finite number") as info:
        load_config(SMOKE, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override", ["data.seed=9223372036854775808", "sft.seed=-9223372036854775809",
                                      "grpo.seed=99999999999999999999999", "evaluate.seed=18446744073709551615"])
def test_seeds_beyond_int64_are_refused(override):
    """Every integer key fits int64; GRPO's seeds have the tighter bound their sampling streams need."""
    bound = "50" if override.startswith("grpo") else "63"
    with pytest.raises(ConfigError, match=rf"seed = -?\d+ is out of range; allowed: an integer in \[-2\*\*{bound}, 2\*\*{bound}\)"):
        load_config(SMOKE, [override])


def test_largest_int64_seed_is_accepted():
    assert load_config(SMOKE, ["data.seed=9223372036854775807"]).data.seed == 2**63 - 1


def test_a_huge_integer_for_a_float_is_refused():
    with pytest.raises(ConfigError, match="grpo.lr"):
        load_config(SMOKE, [f"grpo.lr={10**400}"])


@pytest.mark.parametrize("text,line,key", [
    ("data:\n  seed: 1\nsft:\n  steps: 2\ndata:\n  val_size: 3\n", 5, "data"),
    ("grpo:\n  lr: 1.0e-4\n  group_size: 4\n  lr: 2.0e-4\n", 4, "lr"),
    ("grpo: {lr: 1.0e-4, lr: 2.0e-4}\n", 1, "lr"),
])
def test_duplicate_keys_and_sections_are_refused(tmp_path, text, line, key):
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=rf"dup.yaml:{line}: duplicate key '{key}'"):
        load_config(p)


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing but a comment\n", "---\n", "{}\n"])
def test_an_empty_params_file_is_refused(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="empty.yaml: the params file is empty"):
        load_config(p)


@pytest.mark.parametrize("data,pattern", [
    (bytes(range(256)) * 8, r"bin.yaml:\d+: not a UTF-8 text file"),
    (b"data:\n  seed: 1\x00\n", r"bin.yaml:2: holds a NUL byte"),
    (b"data:\n  gsm8k_source: caf\xe9\n", r"bin.yaml:2: not a UTF-8 text file"),
    (b"\x89PNG\r\n\x1a\n" + bytes(100), r"bin.yaml:1: not a UTF-8 text file"),
    (b"data:\n  seed: 1\n" + b"#" * (2 << 20), r"bin.yaml: \d+ bytes is too large"),
])
def test_binary_or_huge_params_files_are_refused(tmp_path, data, pattern):
    p = tmp_path / "bin.yaml"
    p.write_bytes(data)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(p)
    assert "\n" not in str(info.value)


def test_a_bom_and_crlf_are_fine(tmp_path):
    p = tmp_path / "bom.yaml"
    p.write_bytes(b"\xef\xbb\xbfdata:\r\n  seed: 7\r\n")
    assert load_config(p).data.seed == 7


@pytest.mark.parametrize("args,needle", [
    (["--set", "grpo.lr=inf"], "grpo.lr"),
    (["--set", "data.seed=18446744073709551616"], "data.seed"),
    (["--params", "{dir}/dup.yaml"], "duplicate key"),
    (["--params", "{dir}/empty.yaml"], "empty"),
    (["--params", "{dir}/bin.yaml"], "UTF-8"),
])
def test_cli_says_one_line_and_exits_2(tmp_path, args, needle):
    (tmp_path / "dup.yaml").write_text("grpo:\n  lr: 1\ngrpo:\n  lr: 2\n")
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "bin.yaml").write_bytes(bytes(range(128, 256)))
    args = [a.format(dir=tmp_path) for a in args]
    if "--params" not in args:
        args += ["--params", str(SMOKE)]
    res = subprocess.run([sys.executable, "-m", "pipeline", "grpo", *args, "--print-config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert needle in res.stderr


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """Nested aliases expand exponentially: 4 lines of 20 became a 1 MB error line, a few more hang."""
    p = tmp_path / "lol.yaml"
    p.write_text("tracking:\n  experiment: &l0 [x, x, x, x]\n  uri: &l1 [*l0, *l0, *l0, *l0]\n"
                 "data:\n  prompt_template: [*l1, *l1, *l1, *l1]\n")
    with pytest.raises(ConfigError, match=r"lol.yaml:3: YAML aliases \(\*l0\) are not allowed"):
        load_config(p)


def test_a_huge_wrong_value_gives_a_short_line(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("data:\n  prompt_template: [" + ", ".join(["word"] * 5_000) + "]\n")
    with pytest.raises(ConfigError, match=r"data.prompt_template = \['word', .*\.\.\. has the wrong type") as info:
        load_config(p)
    assert len(str(info.value)) < 300
