"""Device placement of the GRPO loop, checked on any machine: one iteration on a simulated
accelerator (tests/fake_accelerator.py says how and why), and the same on CUDA where present; under
bf16 autocast too (CUDA's default compute path), with the from-scratch GPT and with a transformers
Qwen2 trained through LoRA adapters with gradient checkpointing.

The three crashes a first GPU run would hit (the sampling generator on the CPU, CPU rewards in
the loss, CPU tensors in NCCL all-reduces) each fail the simulated iteration with CUDA's message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

from pipeline.core import distributed as dist_utils
from pipeline.core.config_loading import config_from_dict
from tests.conftest import tiny_model_config
from tests.fake_accelerator import AUTOCAST_COUNTS, DEVICE, DeviceMismatch, OnDevice, simulated_accelerator

ROWS = [(a, b) for a in range(3, 9) for b in range(2, 5)]


def _row(i: int, a: int, b: int) -> dict:
    q = f"What is {a} + {b}?"
    return {"id": f"a{i}", "source": "arith", "question": q, "prompt": f"Question: {q}\nAnswer:",
            "gold": float(a + b), "solution": f"{a} + {b} = <answer>{a + b}</answer>", "level": 1}


def _write_rows(tmp_path, monkeypatch) -> None:
    """The warmup's prepared rows (arithmetic, train and held-out) in `tmp_path`, made the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("arith_train", "arith_eval"):
        rows = [_row(i, a, b) for i, (a, b) in enumerate(ROWS)]
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def stage_dir(tmp_path, monkeypatch, tiny_tokenizer):
    """A working directory for the warmup stage: arithmetic rows and a tiny GPT as the SFT checkpoint."""
    from pipeline.model.policy import build_policy
    from pipeline.train.checkpoint import save_policy

    _write_rows(tmp_path, monkeypatch)
    torch.manual_seed(0)
    save_policy(tmp_path / "checkpoints" / "sft", build_policy(tiny_model_config(), tiny_tokenizer))
    return tmp_path


def _cfg(device: str, model=None, **warmup):
    base = dict(iterations=1, prompts_per_iter=2, group_size=4, rollout_len=6, eval_every=0, kl_coef=0.04,
                minibatch_groups=1, dynamic_sampling=False, lr_schedule="constant", warmup_iters=0)
    base.update(warmup)
    cfg = config_from_dict({"model": model or dataclasses.asdict(tiny_model_config()), "warmup": base,
                            "sft": {"max_len": 64}, "grpo": {"rollout_len": 16}, "tracking": {"enabled": False}})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device))


@contextlib.contextmanager
def process_group():
    """A real one-process gloo group, so the trainer's all-reduces run (they are skipped without one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        dist_utils.use_device(None)


def _iteration(device, model=None) -> dict:
    from pipeline.stages.grpo import TrainState, grpo_iteration, setup

    run = setup(_cfg(str(device), model), "warmup")
    metrics, _ = grpo_iteration(run, TrainState(total_iters=1))
    return metrics


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")  # see fake_accelerator.py
def test_grpo_iteration_keeps_every_tensor_on_the_accelerator(stage_dir):
    with process_group(), simulated_accelerator() as dev:
        metrics = _iteration(dev)
    assert all(math.isfinite(metrics[k]) for k in ("reward", "kl", "loss", "grad_norm"))
    assert metrics["tokens_per_s"] > 0


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_a_bf16_autocast_iteration_keeps_every_tensor_on_the_accelerator(stage_dir):
    """`model.dtype: bfloat16` (what `auto` is on CUDA): the matmuls run in bf16 on the device."""
    AUTOCAST_COUNTS["lower_precision"] = 0
    model = {**dataclasses.asdict(tiny_model_config()), "dtype": "bfloat16"}
    with process_group(), simulated_accelerator() as dev:
        metrics = _iteration(dev, model)
    assert all(math.isfinite(metrics[k]) for k in ("reward", "kl", "loss", "grad_norm"))
    assert AUTOCAST_COUNTS["lower_precision"] > 0


@pytest.fixture
def hf_stage_dir(tmp_path, monkeypatch, hf_dirs):
    """The warmup's working directory with a tiny transformers Qwen2 (LoRA, gradient checkpointing) as
    the SFT checkpoint."""
    from pipeline.data.tokenizer import load_hf_tokenizer
    from pipeline.model.policy import build_policy
    from pipeline.train.checkpoint import save_policy

    _write_rows(tmp_path, monkeypatch)
    model = tiny_model_config(backend="hf", init=str(hf_dirs["qwen2"]), lora_rank=4, gradient_checkpointing=True)
    torch.manual_seed(0)
    save_policy(tmp_path / "checkpoints" / "sft", build_policy(model, load_hf_tokenizer(hf_dirs["qwen2"])))
    return dataclasses.asdict(model)


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_an_hf_lora_iteration_with_gradient_checkpointing_stays_on_the_accelerator(hf_stage_dir, dtype):
    """The transformers backend with LoRA and gradient checkpointing, in fp32 and under bf16 autocast:
    the checkpointed blocks recompute under their forward's autocast (torch checks the recomputed
    tensors' dtypes against the saved ones), and every tensor stays on the device."""
    AUTOCAST_COUNTS["lower_precision"] = 0
    with process_group(), simulated_accelerator() as dev:
        metrics = _iteration(dev, {**hf_stage_dir, "dtype": dtype})
    assert all(math.isfinite(metrics[k]) for k in ("reward", "kl", "loss", "grad_norm"))
    assert (AUTOCAST_COUNTS["lower_precision"] > 0) == (dtype == "bfloat16")


def test_the_simulation_raises_cudas_errors():
    """The three rules, one op each (what a reintroduced crash runs into)."""
    with simulated_accelerator() as dev:
        x = torch.ones(4, device=dev)
        assert isinstance(x, OnDevice) and x.device == DEVICE
        with pytest.raises(DeviceMismatch, match="same device"):
            x * torch.ones(4)  # a CPU tensor in an accelerator op (CPU rewards in the loss)
        x * torch.tensor(2.0)  # a 0-dim CPU tensor is allowed, as on CUDA
        x[torch.tensor([0, 1])]  # so are CPU index tensors
        with pytest.raises(DeviceMismatch, match="generator"):
            torch.rand(4, device=dev, generator=torch.Generator().manual_seed(0))
        torch.rand(4, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        with process_group():
            with pytest.raises(DeviceMismatch, match="No backend type"):
                dist.all_reduce(torch.ones(2))
            y = torch.ones(2, device=dev)
            dist.all_reduce(y)
            assert y.cpu().tolist() == [1.0, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grpo_iteration_on_cuda(stage_dir):
    with process_group():
        metrics = _iteration("cuda")
    assert all(math.isfinite(metrics[k]) for k in ("reward", "kl", "loss", "grad_norm"))
