"""bench/memory.py --estimate: the parameter count it works from is the model's own, the activations
it counts per layer are what autograd saves (measured with saved-tensor hooks), and the options that
bound memory (micro-batches, gradient checkpointing, LoRA, bf16) lower the phase they act on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def estimate(*args: str, params: Path = ROOT / "configs" / "instruct.yaml") -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--params",
                           str(params), *args], capture_output=True, text=True,
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


@pytest.mark.slow
def test_memory_options_lower_their_phase():
    base = estimate("--size", "1.5B")
    assert estimate("--size", "1.5B", "--set", "grpo.micro_batch_size=0")["update"] > base["update"]
    assert estimate("--size", "1.5B", "--set", "model.gradient_checkpointing=true")["update"] < base["update"]
    lora = estimate("--size", "1.5B", "--set", "model.lora_rank=16")
    assert lora["static"] < base["static"] / 2 and lora["trainable"] < base["trainable"] / 100
    assert estimate("--size", "1.5B", "--set", "model.param_dtype=bfloat16")["static"] < base["static"]


def test_fsdp_divides_the_training_state_and_adds_the_samplers_copy():
    """7B in fp32 with the KL over 8 ranks: DDP holds 20 bytes a weight on each (policy 4, reference 4,
    gradients 4, AdamW's two moments 8); fsdp holds 20 / 8 of them plus the sampler's whole copy (4): 6.5."""
    run = ("--size", "7B", "--set", "model.param_dtype=float32", "--set", "grpo.nproc=8",
           "--set", "grpo.minibatch_groups=8")
    ddp, fsdp = estimate(*run), estimate(*run, "--set", "grpo.parallel=fsdp")
    assert fsdp["static"] == pytest.approx(ddp["static"] * 6.5 / 20, abs=0.02)
    # a pass gathers the root (embeddings, head: 2 x 152064 x 3584 fp32 weights) and two blocks
    assert (fsdp["update"] - fsdp["static"]) - (ddp["update"] - ddp["static"]) >= 2 * 152064 * 3584 * 4 / 1e9
    assert fsdp["peak_gb"] < ddp["peak_gb"] and fsdp["evaluate"] == ddp["evaluate"]


CARD_RECIPES = sorted(ROOT.glob("configs/qwen2.5-*-*gb.yaml"))


@pytest.mark.parametrize("path", CARD_RECIPES, ids=lambda p: p.stem)
def test_each_card_recipe_fits_its_card_and_says_so(path):
    """configs/qwen2.5-<size>[-lora]-<N>gb.yaml: the estimated peak plus the 10% allocator margin is
    within N GB, and the header states the estimate the bench prints."""
    import re

    size, card = re.match(r"qwen2\.5-([\d.]+b)(?:-lora)?-(\d+)gb$", path.stem).groups()
    est = estimate("--size", size.upper(), params=path)
    assert est["peak_gb"] * 1.1 <= int(card), (path.name, est["peak_gb"])
    assert f"Estimated peak {est['peak_gb']:.1f} GB" in path.read_text()


def test_there_is_a_recipe_per_card_for_a_small_full_fine_tune_and_a_7b_lora():
    names = {p.name for p in CARD_RECIPES}
    assert {"qwen2.5-0.5b-80gb.yaml", "qwen2.5-7b-lora-24gb.yaml", "qwen2.5-7b-lora-80gb.yaml"} <= names
    # the 0.5B full fine-tune on a 24 GB card is configs/instruct.yaml itself
    assert estimate("--size", "0.5B")["peak_gb"] * 1.1 <= 24


def _saved_bytes(layers: int, autocast: bool, rows: int = 2, T: int = 64) -> int:
    """Bytes autograd saves for backward in a forward of a random Qwen2 decoder of `layers` layers
    (SDPA attention), each storage once, not counting the weights or autocast's copies of them."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=192, intermediate_size=640, num_hidden_layers=layers,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    weights = {tuple(p.shape) for p in model.parameters()}
    weights |= {s[::-1] for s in weights}
    saved: dict[int, int] = {}

    def pack(t):
        if tuple(t.shape) not in weights:  # a weight, or autocast's bf16 copy of one (counted apart)
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 512, (rows, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.model(input_ids=ids)
    return sum(saved.values())


def test_activations_per_layer_are_what_autograd_saves():
    """One more layer adds what the estimator counts per layer and token, within 1%, under bf16
    autocast over fp32 weights (where it once counted everything as bf16: 0.82x) and in fp32."""
    sys.path.insert(0, str(ROOT / "bench"))
    from memory_estimate import Shape, layer_activation_bytes

    shape = Shape(layers=1, d=192, ffn=640, heads=6, kv_heads=2, vocab=512, tied=True)
    tokens = 2 * 64
    for autocast in (True, False):
        per_layer = (_saved_bytes(3, autocast) - _saved_bytes(2, autocast)) / tokens
        assert abs(per_layer / layer_activation_bytes(shape, autocast) - 1) < 0.01, (autocast, per_layer)
