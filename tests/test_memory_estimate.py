"""bench/memory.py --estimate: the parameter count it works from is the model's own, and the
options that bound memory (micro-batches, gradient checkpointing, LoRA, bf16) lower the phase they
act on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def estimate(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--params",
                           str(ROOT / "configs" / "instruct.yaml"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "one 80 GB card" in proc.stdout and "one 141 GB card" in proc.stdout
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_parameter_count_is_the_models_own(hf_dirs):
    from pipeline.model.policy import build_policy
    from tests.conftest import tiny_model_config

    policy = build_policy(tiny_model_config(backend="hf", init=hf_dirs["qwen2"]))
    assert estimate("--hf-config", hf_dirs["qwen2"])["params"] == policy.num_params()
    assert estimate("--size", "0.5B")["params"] == 494_032_768  # Qwen2.5-0.5B's published count


def test_memory_options_lower_their_phase():
    base = estimate("--size", "1.5B")
    assert estimate("--size", "1.5B", "--set", "grpo.micro_batch_size=0")["update"] > base["update"]
    assert estimate("--size", "1.5B", "--set", "model.gradient_checkpointing=true")["update"] < base["update"]
    lora = estimate("--size", "1.5B", "--set", "model.lora_rank=16")
    assert lora["static"] < base["static"] / 2 and lora["trainable"] < base["trainable"] / 100
    assert estimate("--size", "1.5B", "--set", "model.param_dtype=bfloat16")["static"] < base["static"]
