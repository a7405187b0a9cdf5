"""Config loading: every rule gives one clear line naming the key; the CLI exits 2 without a traceback."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.config import Config, ConfigError
from pipeline.core.config_loading import config_from_dict, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_params_yaml_and_smoke_load_and_match_schema(monkeypatch):
    from pipeline.core import config_loading

    default = load_config(ROOT / "params.yaml")
    assert default.grpo.group_size == 8 and default.grpo.clip == 0.2 and default.grpo.kl_coef == 0.04
    assert default.grpo.temperature == 1.0 and default.grpo.grpo_epochs == 1 and default.grpo.grad_clip == 1.0
    assert default.data.gsm8k_source == "./datasets/gsm8k"
    load_config(ROOT / "configs" / "smoke.yaml")
    monkeypatch.setattr(config_loading, "has_gpu", lambda: True)  # gpu.yaml's model does not fit a CPU's memory
    load_config(ROOT / "configs" / "gpu.yaml")


def test_params_yaml_lists_every_field():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(raw) == set(Config().to_dict())
    for section, values in Config().to_dict().items():
        assert set(raw[section]) == set(values), f"params.yaml section {section} differs from pipeline/core/config.py"
    # ...and holds the same values: the dataclass defaults are the defaults of `--params` files that omit a key
    assert load_config(ROOT / "params.yaml").to_dict() == Config().to_dict()


def test_params_yaml_is_written_from_the_dataclasses():
    """params.yaml's values are the defaults and its comments the section and field docstrings of
    pipeline/core/config.py, so the two cannot drift; regenerate with `python -m pipeline.core.config_render > params.yaml`."""
    from pipeline.core.config_render import field_docs, render_params

    text = (ROOT / "params.yaml").read_text()
    assert text == render_params(Config()), "params.yaml is stale: python -m pipeline.core.config_render > params.yaml"
    assert "  # Peak AdamW learning rate.\n  lr: 0.003\n" in text  # a field docstring, then its key
    docs = field_docs(type(Config().warmup))
    assert docs["adaptive"].startswith("Adaptive curriculum") and docs["lr"] == "Peak AdamW learning rate."


def test_warmup_defaults_differ_only_where_declared():
    from pipeline.core.config import WARMUP_DEFAULTS

    warmup, grpo = Config().warmup.__dict__, Config().grpo.__dict__
    differ = {k for k in grpo if warmup[k] != grpo[k]}
    assert differ == set(WARMUP_DEFAULTS)
    # a params file that sets one warmup key keeps the warmup's other defaults, not grpo's
    cfg = config_from_dict({"warmup": {"lr": 0.5}})
    assert cfg.warmup.lr == 0.5 and cfg.warmup.iterations == WARMUP_DEFAULTS["iterations"]


def test_dump_round_trips():
    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["grpo.kl_coef=0.02"])
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg and again.grpo.kl_coef == 0.02


@pytest.mark.parametrize("override,pattern", [
    ("grpo.group_size=1", r"grpo\.group_size = 1 is out of range; allowed: an integer in \[2, 1024\]"),
    ("warmup.group_size=0", r"warmup\.group_size = 0 is out of range"),
    ("grpo.clip=0", r"grpo\.clip = 0.0 is out of range; allowed: a number in \(0, 1\)"),
    ("grpo.clip=1.0", r"grpo\.clip = 1.0 is out of range"),
    ("grpo.lr=0", r"grpo\.lr = 0.0 is out of range; allowed: a number > 0"),
    ("sft.lr=-1e-3", r"sft\.lr = -0.001 is out of range"),
    ("grpo.temperature=0", r"grpo\.temperature = 0.0 is out of range; allowed: a number > 0"),
    ("grpo.top_p=0", r"grpo\.top_p = 0.0 is out of range; allowed: a number in \(0, 1\]"),
    ("grpo.top_p=1.5", r"grpo\.top_p = 1.5 is out of range"),
    ("grpo.kl_coef=-0.1", r"grpo\.kl_coef = -0.1 is out of range"),
    ("model.n_embd=102", r"model\.n_embd = 102 .*divisible by model\.n_head"),
    ("data.prompt_template=hello", r"data\.prompt_template .*containing \{question\}"),
    ("grpo.rollout_len=100000", r"grpo\.rollout_len = 100000 .*model\.block_size"),
    ("grpo.clipp=0.3", r"unknown key grpo\.clipp \(did you mean grpo\.clip\?\)"),
    ("grop.clip=0.3", r"unknown section 'grop' \(did you mean grpo\?\)"),
    ("grpo.group_size=eight", r"grpo\.group_size = 'eight' has the wrong type; expected an integer"),
    ("grpo.group_size=2.5", r"grpo\.group_size = 2\.5 has the wrong type; expected an integer"),
    ("grpo.dynamic_sampling=3", r"grpo\.dynamic_sampling = 3 has the wrong type; expected true or false"),
    ("grpo.lr=true", r"grpo\.lr = True has the wrong type; expected a number"),
    ("grpo.adv_norm=grup", r"grpo\.adv_norm = 'grup' is not allowed \(did you mean 'group'\?\); allowed: group, batch, none"),
    ("evaluate.stages=[sft, ppo]", r"evaluate\.stages\[1\] = 'ppo' is not allowed; allowed: sft, control, warmup, grpo"),
    ("evaluate.jobs=-1", r"evaluate\.jobs = -1 is out of range; allowed: an integer >= 0$"),
    ("model.backend=hf", r"model\.backend .*model\.init"),
    ("model.dropout=0.1", r"sft\.nproc = 2 is out of range; allowed: 1 while model\.dropout > 0"),
    # `date +%s%N` as a seed: seed * 7919 would overflow torch's seed range at the first rollout
    ("grpo.seed=1764892800123456789", r"grpo\.seed = 1764892800123456789 is out of range; allowed: an integer in "
                                      r"\[-2\*\*50, 2\*\*50\)"),
    ("warmup.seed=-1125899906842625", r"warmup\.seed = -1125899906842625 is out of range"),
    ("grpo.nproc=3", r"grpo\.prompts_per_iter = 8 is out of range; allowed: a multiple of grpo\.nproc"),
    ("warmup.nproc=8", r"warmup\.minibatch_groups = 4 is out of range; allowed: a multiple of warmup\.nproc "
                       r"\(each process takes an equal share of a minibatch's groups\)"),
])
def test_bad_values_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(ROOT / "params.yaml", [override])
    assert "\n" not in str(info.value)
    assert "params.yaml" in str(info.value)


@pytest.mark.parametrize("override", [
    "grpo.lr=3e-4", "evaluate.stages=[sft, grpo]", "data.system_prompt='Be brief: {question} is it, ok'",
    "data.prompt_template=\"Q: {question}\"", "model.init=models/a-b/model", "grpo.dynamic_sampling=true",
    "tracking.uri=http://127.0.0.1:5000", "grpo.task=countdown",
    "data.system_prompt=", "model.lora_targets=[q_proj,v_proj]", "sft.lr=1e-3",
    "data.system_prompt=007", "data.system_prompt=Ask: why",  # YAML would read 7 and a mapping: DVC reads text
])
def test_set_means_what_dvc_exp_run_s_means(tmp_path, override):
    """One grammar: `--set X` on the CLI gives the config that DVC's own `-S X` (what `dvc exp run -S`
    and a flow run's --set apply to params.yaml) leaves in the file."""
    from flows.experiment import apply_overrides

    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    via_cli = load_config(params, [override])
    apply_overrides(params, [override])
    assert load_config(params) == via_cli
    assert via_cli != load_config(ROOT / "params.yaml") or override.endswith("=")


@pytest.mark.parametrize("override,pattern", [
    ("+grpo.lr=1", r"no \+, \+\+, ~ or @"), ("~grpo.lr", r"no \+, \+\+, ~ or @"), ("lr=1", r"section\.key=value"),
    ("grpo.lr=1,2", r"a sweep"), ("data.prompt_template=Q: {question}", r"not an override .*quote a value"),
])
def test_set_refuses_what_is_no_single_override(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(ROOT / "params.yaml", [override])
    assert "\n" not in str(info.value)


def test_each_key_declares_its_range_and_doc_once():
    """pydantic holds a key's type, default, range and doc in its one declaration: the range is a
    constraint of the field (checked on construction, so `dataclasses.replace` cannot slip past it),
    and the docstring under it is the field's description."""
    import dataclasses

    from pydantic import ValidationError

    from pipeline.core.config import GRPOConfig, WarmupConfig

    info = GRPOConfig.__pydantic_fields__["clip"]
    assert info.description == "PPO/GRPO clip epsilon (lower side, and upper side unless `clip_high` is set)."
    bounds = {attr: getattr(m, attr) for m in info.metadata for attr in ("gt", "lt") if hasattr(m, attr)}
    assert bounds == {"gt": 0, "lt": 1}
    with pytest.raises(ValidationError):
        dataclasses.replace(Config().grpo, clip=1.5)
    with pytest.raises(ValidationError):
        WarmupConfig(group_size=1)
    assert config_from_dict({"grpo": {"clip": 0.3}}).grpo.clip == 0.3


def test_an_unreadable_params_file_is_one_line(tmp_path, monkeypatch):
    """`chmod 000 params.yaml` (root reads it anyway, so the refusal is raised by hand here)."""
    p = tmp_path / "p.yaml"
    p.write_text("grpo:\n  clip: 0.2\n")

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ConfigError, match=r"p\.yaml: cannot read the params file \(Permission denied\)$"):
        load_config(p)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: params file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  clip: [0.2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("grpo: 3\n")
    with pytest.raises(ConfigError, match="section 'grpo' must be a mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(ROOT / "params.yaml", ["clip=0.2"])


def test_yaml_scientific_notation_string_is_accepted(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("grpo:\n  lr: 1e-5\n")  # YAML 1.1 reads this as a string
    assert load_config(p).grpo.lr == 1e-5


@pytest.mark.parametrize("text,value", [("sft:\n  steps: 1:30\n", "1:30"), ("model:\n  compile: on\n", "on"),
                                        ("model:\n  compile: yes\n", "yes"), ("model:\n  compile: Off\n", "Off"),
                                        ("sft:\n  steps: 010\n", "010"), ("sft:\n  lr: 1:30.5\n", "1:30.5"),
                                        ("on:\n  steps: 3\n", "on")])
def test_a_value_yaml_1_1_and_dvcs_yaml_1_2_read_differently_is_refused(tmp_path, text, value):
    """PyYAML (YAML 1.1) reads `1:30` as 90, `on`/`yes` as true and `010` as 8; DVC's reader (YAML 1.2)
    as the strings '1:30', 'on', 'yes' and the number 10: the run would train on one value while
    DVC records another. One line naming the file, the line and the value; quoted text still reads."""
    from ruamel.yaml import YAML

    p = tmp_path / "p.yaml"
    p.write_text(text)
    assert YAML(typ="safe").load(text) != yaml.safe_load(text)  # the two readers disagree on it
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}:\d: {re.escape(value)} is "):
        load_config(p)
    p.write_text("data:\n  system_prompt: 'on'\nsft:\n  steps: 10\nmodel:\n  compile: true\n")
    cfg = load_config(p)
    assert (cfg.data.system_prompt, cfg.sft.steps, cfg.model.compile) == ("on", 10, True)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=120)


def test_cli_error_is_one_line_exit_2():
    res = _cli("grpo", "--set", "grpo.group_size=1")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "grpo.group_size" in res.stderr


@pytest.mark.slow
def test_a_cuda_device_this_machine_lacks_is_one_line_exit_2(tmp_path):
    """`model.device = cuda:N` with no such device: one line naming the key before the stage starts
    (was torch's traceback from the first `.to()`); cuda:63 is absent on any machine that runs this."""
    from pipeline.__main__ import check_device
    from pipeline.core.errors import InputError

    res = _cli("warmup", "--params", str(ROOT / "configs" / "smoke.yaml"), "--set", "model.device=cuda:63",
               cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: model.device = cuda:63: this machine has "), res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written

    def cfg(device):
        return load_config(ROOT / "params.yaml", [f"model.device={device}"])

    with pytest.raises(InputError, match=r"^model\.device = cuda: this machine has no CUDA device; allowed here: "
                                         r"auto, cpu$"):
        check_device(cfg("cuda"), "sft", 0)
    with pytest.raises(InputError, match=r"has CUDA devices 0-1; allowed here: auto, cpu or cuda:0 to cuda:1$"):
        check_device(cfg("cuda:2"), "grpo", 2)
    check_device(cfg("cuda:1"), "grpo", 2)
    check_device(cfg("cuda"), "prepare", 0)  # prepare builds no model
    check_device(cfg("cpu"), "evaluate", 0)


def test_cli_print_config_applies_overrides():
    res = _cli("grpo", "--params", "configs/smoke.yaml", "--set", "grpo.kl_coef=0.02", "--print-config")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    assert printed["grpo"]["kl_coef"] == 0.02 and printed["model"]["n_layer"] == 2


def test_the_sft_stage_alone_runs_on_sft_num_threads():
    """The sft stage runs alone in the pipeline's graph: `sft.nproc` processes of `sft.num_threads` threads
    each (the default fills two cores); the control and the warmup, which run side by side, and every
    other stage take `model.num_threads`."""
    import torch

    from pipeline.stages import apply_runtime, stage_threads

    cfg = load_config(ROOT / "params.yaml")
    assert cfg.sft.nproc * stage_threads(cfg, "sft") == 2 and cfg.control.nproc == 1
    assert {stage_threads(cfg, s) for s in ("prepare", "warmup", "control", "grpo", "evaluate")} == {1}
    assert stage_threads(load_config(ROOT / "params.yaml", ["sft.num_threads=0"]), "sft") == 1
    assert stage_threads(load_config(ROOT / "params.yaml", ["sft.num_threads=3"]), "sft") == 3
    saved = torch.get_num_threads()
    try:
        apply_runtime(load_config(ROOT / "params.yaml", ["sft.num_threads=2"]), "sft")
        assert torch.get_num_threads() == 2
        apply_runtime(cfg, "control")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_control_nproc_refuses_dropout_too():
    with pytest.raises(ConfigError, match=r"control\.nproc = 2 is out of range; allowed: 1 while model\.dropout"):
        load_config(ROOT / "params.yaml", ["sft.nproc=1", "control.nproc=2", "model.dropout=0.1"])
    assert load_config(ROOT / "params.yaml", ["sft.nproc=1", "model.dropout=0.1"]).model.dropout == 0.1


def test_torchrun_ranks_get_gloo_on_the_cpu_and_one_gpu_each_on_cuda():
    """The launcher's environment for the ranks: a CPU model hides the GPUs (so the ranks take gloo,
    not NCCL, which has no CPU tensors); a CUDA model needs a device per rank, else one line naming
    the key."""
    from pipeline.__main__ import ranks_env
    from pipeline.core.errors import InputError

    def cfg(device):
        return load_config(ROOT / "params.yaml", [f"model.device={device}"])

    assert ranks_env(cfg("auto"), "sft", 2, 0) == {}  # no GPU: gloo anyway
    assert ranks_env(cfg("cpu"), "sft", 2, 0) == {}
    assert ranks_env(cfg("cpu"), "sft", 2, 4) == {"CUDA_VISIBLE_DEVICES": ""}
    assert ranks_env(cfg("auto"), "grpo", 8, 8) == {} and ranks_env(cfg("cuda"), "sft", 2, 2) == {}
    with pytest.raises(InputError, match=r"^sft\.nproc = 2 needs 2 CUDA devices \(one per rank\) and this machine "
                                         r"has 1; set sft\.nproc to at most 1"):
        ranks_env(cfg("auto"), "sft", 2, 1)
    with pytest.raises(InputError, match=r"warmup\.nproc = 4 needs 4 CUDA devices"):
        ranks_env(cfg("cuda"), "warmup", 4, 0)


# --------------------------------------------------------------------------- sizes the machine cannot hold

ABSURD = [("sft", "model.block_size=1000000000"), ("sft", "model.n_layer=1000000"),
          ("warmup", "warmup.group_size=2000000"), ("prepare", "data.arith_train_size=2000000000"),
          ("evaluate", "evaluate.samples=100000000")]


def _capped_cli(*args: str, cap_gb: float = 2.0, cwd=ROOT) -> subprocess.CompletedProcess:
    """The CLI under an address-space cap (`ulimit -v`): a run that tried to allocate would fail, not
    take the machine down."""
    import resource

    cap = int(cap_gb * 2**30)
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))


@pytest.mark.parametrize("stage,override", ABSURD)
def test_absurd_sizes_stop_the_stage_with_one_line_before_any_work(stage, override, tmp_path):
    """Each of these passed validation and then asked for gigabytes to terabytes (or ran until the OOM
    killer came): now the stage itself stops at once, exit 2, one line naming the key and its bound."""
    import time

    key, value = override.split("=")
    started = time.monotonic()
    res = _capped_cli(stage, "--params", str(ROOT / "params.yaml"), "--set", override, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.startswith(f"error: {ROOT / 'params.yaml'}: {key} = {value} is out of range; allowed: an "
                                 "integer in ["), res.stderr
    assert time.monotonic() - started < 10 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,pattern", [
    ("model.block_size=131073", r"model\.block_size = 131073 is out of range; allowed: an integer in \[16, 131072\]"),
    ("model.n_layer=1025", r"model\.n_layer = 1025 is out of range; allowed: an integer in \[1, 1024\]"),
    ("grpo.group_size=1025", r"grpo\.group_size = 1025 is out of range; allowed: an integer in \[2, 1024\]"),
    ("data.arith_train_size=10000001", r"data\.arith_train_size = 10000001 is out of range; allowed: an integer in "
                                       r"\[1, 10000000\]"),
    ("evaluate.samples=1025", r"evaluate\.samples = 1025 is out of range; allowed: an integer in \[0, 1024\]"),
])
def test_upper_bounds_are_named_in_the_message(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(ROOT / "params.yaml", [override])


@pytest.fixture
def cpu_machine(monkeypatch):
    """A CPU-only machine with 16 GB of memory, whatever runs the tests."""
    from pipeline.core import config_loading

    monkeypatch.setattr(config_loading, "machine_memory", lambda: (16 * 10**9, "of memory"))
    monkeypatch.setattr(config_loading, "has_gpu", lambda: False)


def test_sizes_each_in_bounds_that_together_need_more_than_the_machine_are_one_line(cpu_machine):
    """The estimate (weights, AdamW and reference, the rollout's KV cache or a training pass's logits,
    evaluate's generation batch; prepare's rows) against the machine's memory: the key most above its
    default is named, with both figures."""
    cases = [(["model.n_layer=1024", "model.n_embd=4096"], "model.n_layer = 1024"),
             (["warmup.prompts_per_iter=4096", "warmup.minibatch_groups=0"], "warmup.prompts_per_iter = 4096"),
             (["evaluate.samples=1024"], "evaluate.samples = 1024"),
             (["evaluate.batch_size=4096"], "evaluate.batch_size = 4096"),
             (["warmup.group_size=1024", "warmup.rollout_len=500"], "warmup.group_size = 1024"),
             (["data.arith_train_size=9000000"], "data.arith_train_size = 9000000")]
    for overrides, named in cases:
        with pytest.raises(ConfigError, match=rf"^\S+params\.yaml: {re.escape(named)}: needs ~[\d.,]+ GB of memory "
                                              r"\(.+\), more than the 16\.0 GB this machine has of memory; ") as info:
            load_config(ROOT / "params.yaml", overrides)
        assert "\n" not in str(info.value)


def test_every_committed_config_fits_a_16_gb_machine(cpu_machine, monkeypatch):
    """Every committed config is within the bounds, and fits a 16 GB machine: a CPU-only one, or for
    configs/gpu.yaml one with a GPU (on the CPU its evaluate batch alone would take ~65 GB)."""
    from pipeline.core import config_loading

    configs = [ROOT / "params.yaml", *sorted((ROOT / "configs").glob("*.yaml")),
               *sorted((ROOT / "recipes").glob("*/params.yaml"))]
    assert len(configs) >= 5
    for path in configs:
        if path.name != "gpu.yaml":
            load_config(path)
    with pytest.raises(ConfigError, match=r"needs ~\d+\.\d GB of memory \(evaluate: "):
        load_config(ROOT / "configs" / "gpu.yaml")
    monkeypatch.setattr(config_loading, "has_gpu", lambda: True)
    load_config(ROOT / "configs" / "gpu.yaml")


def test_the_estimate_leaves_gpu_runs_and_hf_models_to_their_own_checks(cpu_machine, monkeypatch):
    """On a GPU the weights live in its memory, which the config cannot see; an hf model's size is
    the model's, not the config's: neither is compared with this machine's memory here."""
    from pipeline.core import config_loading

    big = ["model.n_layer=1024", "model.n_embd=4096"]
    load_config(ROOT / "params.yaml", [*big, "model.device=cuda"])
    load_config(ROOT / "params.yaml", [*big, "model.backend=hf", "model.init=some/model"])
    monkeypatch.setattr(config_loading, "has_gpu", lambda: True)
    load_config(ROOT / "params.yaml", big)  # device auto with a GPU here
    with pytest.raises(ConfigError, match=r"model\.n_layer = 1024: needs"):
        load_config(ROOT / "params.yaml", [*big, "model.device=cpu"])


def test_the_machines_memory_is_the_least_of_ram_cgroup_and_address_space_limit(tmp_path, monkeypatch):
    from pipeline.core import config_loading

    ram, _ = config_loading.machine_memory()
    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    monkeypatch.setattr(config_loading, "CGROUP_LIMITS", (str(tmp_path / "absent"), str(limit)))
    assert config_loading.machine_memory() == (1073741824, "under its cgroup's memory limit")
    limit.write_text("max\n")  # cgroup v2 without a limit
    assert config_loading.machine_memory()[0] == ram


def test_an_address_space_cap_counts_as_the_machines_memory():
    """Under `ulimit -v 2G`, a million arithmetic rows (~7.5 GB in prepare) are refused at once."""
    res = _capped_cli("prepare", "--set", "data.arith_train_size=1000000", "--print-config")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "data.arith_train_size = 1000000: needs ~" in res.stderr and "address-space limit" in res.stderr


def test_the_estimate_counts_bf16_weights_with_their_fp32_masters_and_moments(cpu_machine):
    """bf16 halves the weights, gradients and reference but not AdamW's fp32 moments, and adds the fp32
    masters (training.MasterAdamW): 18 bytes a parameter with the reference, against 20 in fp32."""
    from pipeline.core.config_loading import _gpt_params, _grpo_need, load_config

    for dtype, per_param in (("float32", 20), ("bfloat16", 18)):
        cfg = load_config(ROOT / "params.yaml", [f"model.param_dtype={dtype}", "warmup.kl_coef=0.04",
                                                 "model.n_layer=24", "model.n_embd=1024", "model.n_head=16",
                                                 "evaluate.batch_size=1", "evaluate.samples=0"])
        assert _gpt_params(cfg) > 300e6  # large enough that 2 bytes a parameter show in the 0.1 GB figure
        size = 2 if dtype == "bfloat16" else 4
        what, need, _ = _grpo_need(cfg, "warmup", _gpt_params(cfg) * size, size)
        model_gb = float(what.split("reference ")[1].split(" GB")[0].replace(",", ""))
        assert abs(model_gb - _gpt_params(cfg) * per_param / 1e9) < 0.051, (dtype, what)
