"""The pretrained instruct-model path (configs/instruct.yaml): the model's own tokenizer and chat
template in prepare, rollout and evaluation; tiny random Qwen2 (GQA) and Llama models with a chat
template built from a config (tests/conftest.py), nothing downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.core.config_loading import load_config
from tests.conftest import CHAT_TEMPLATE, tiny_model_config

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Be brief."
QUESTIONS = [(f"Tom has {a} pens and gets {b} more. How many pens?", a, b) for a in range(2, 9) for b in (1, 3)]


def write_gsm8k(folder: Path) -> Path:
    """A GSM8K-format source (train.jsonl + test.jsonl) of short word problems."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"question": q, "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"} for q, a, b in QUESTIONS]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[10:]))
    return folder


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny_tokenizer):
    from tests.conftest import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("qwen2") / "m", "qwen2", tiny_tokenizer, CHAT_TEMPLATE,
                        max_positions=512)


def instruct_overrides(gsm8k: Path, init: str) -> list[str]:
    """configs/instruct.yaml cut to seconds on a tiny model."""
    return [f"data.gsm8k_source={gsm8k}", "data.val_size=2", "data.arith_train_size=8", "data.arith_eval_size=4",
            f"data.system_prompt={SYSTEM}", f"model.init={init}", "model.device=cpu", "model.num_threads=1",
            "model.block_size=512", "sft.max_len=512", "warmup.rollout_len=8", "grpo.iterations=2",
            "grpo.prompts_per_iter=2", "grpo.group_size=2", "grpo.minibatch_groups=1", "grpo.rollout_len=8",
            "grpo.eval_every=2", "grpo.eval_samples=2", "grpo.save_every=1", "grpo.lr=1e-3",
            "evaluate.gsm8k_limit=2", "evaluate.arith_limit=2", "evaluate.batch_size=2",
            "evaluate.max_new_tokens=8", "tracking.enabled=false"]


def test_chat_prompt_is_the_tokenizers_template(hf_dirs):
    from pipeline.data.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(hf_dirs["llama"])
    text = tok.chat_prompt("What is 2 + 3?", "Be brief.")
    eos = tok.hf.eos_token
    assert text == f"<|im_start|>system\nBe brief.{eos}\n<|im_start|>user\nWhat is 2 + 3?{eos}\n<|im_start|>assistant\n"
    assert tok.chat_prompt("Q").startswith("<|im_start|>user\nQ")  # no system turn when empty
    with pytest.raises(ValueError, match="no chat template"):
        load_hf_tokenizer(hf_dirs["gpt2"]).chat_prompt("Q")


def test_prepare_with_the_hf_backend_uses_the_model_tokenizer_and_template(tmp_path, monkeypatch, qwen2_dir):
    from pipeline.data.tokenizer import load_hf_tokenizer
    from pipeline.stages.prepare import run_prepare

    gsm8k = write_gsm8k(tmp_path / "gsm8k")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "instruct.yaml", instruct_overrides(gsm8k, qwen2_dir))
    run_prepare(cfg)
    tok = load_hf_tokenizer(qwen2_dir)
    # no BPE trained: data/tokenizer.json is the model tokenizer's own
    assert (tmp_path / "data" / "tokenizer.json").read_text() == tok.to_str()
    for name in ("gsm8k_train", "gsm8k_test", "arith_eval"):
        rows = [json.loads(line) for line in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()]
        for r in rows:
            user = cfg.data.prompt_template.replace("{question}", r["question"])
            assert r["prompt"] == tok.chat_prompt(user, SYSTEM)


def test_chat_template_needs_the_hf_backend():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(ROOT / "configs" / "smoke.yaml"),
                           "--set", "data.chat_template=true", "--print-config"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and "data.chat_template" in proc.stderr and "hf" in proc.stderr


def test_qwen2_shared_prefix_decoding_equals_a_full_forward(qwen2_dir):
    """G rows reading one copy of their prompt's keys (GQA, q/k/v biases) give each row's logits of
    one full forward over its own sequence."""
    from pipeline.model.gpt import positions_from_mask
    from pipeline.model.policy import build_policy

    policy = build_policy(tiny_model_config(backend="hf", init=qwen2_dir)).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    ids[0, :2] = policy.tokenizer.pad_id
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    G = 3
    nxt = torch.arange(20, 20 + 2 * G * 3).view(2 * G, 3)  # every row its own continuation
    with torch.no_grad():
        dec = policy.decoder(9)
        assert dec.inner.shared
        pos = positions_from_mask(mask)
        steps = [dec.prefill(ids, mask, pos, G)]
        for t in range(2):
            steps.append(dec.step(nxt[:, t], pos.repeat_interleave(G, 0)[:, -1] + 1 + t))
        rows_ids = torch.cat([ids.repeat_interleave(G, 0), nxt], 1)
        rows_mask = torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(nxt)], 1)
        full = policy.logits(rows_ids, rows_mask)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:8], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_instruct_config_end_to_end_on_cpu(tmp_path, qwen2_dir):
    """Every stage of configs/instruct.yaml on a tiny Qwen2 through the CLI; the grpo checkpoint
    loads with from_pretrained, and the rollout prompts of the grpo stage are the chat template's."""
    from transformers import AutoModelForCausalLM

    gsm8k = write_gsm8k(tmp_path / "gsm8k")
    work = tmp_path / "w"
    work.mkdir()
    overrides = instruct_overrides(gsm8k, qwen2_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipeline", "all", "--params", str(ROOT / "configs" / "instruct.yaml")]
    proc = subprocess.run(cmd + [x for o in overrides for x in ("--set", o)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((work / "metrics" / "eval.json").read_text())
    assert set(metrics) == {"sft", "grpo"}
    AutoModelForCausalLM.from_pretrained(work / "checkpoints" / "grpo")

    from pipeline.rl.group_sampling import sample_groups
    from pipeline.stages.grpo import setup

    os.chdir(work)
    try:
        cfg = load_config(ROOT / "configs" / "instruct.yaml", overrides)
        run = setup(cfg, "grpo")
        groups = sample_groups(run.policy, run.train_rows, (0, 0), run.conf, run.rewards, run.generator)
    finally:
        os.chdir(ROOT)
    ro, tok = groups.rollout, run.policy.tokenizer
    for i, row in enumerate(groups.rows):
        prompt = tok.hf.decode(ro.input_ids[i * cfg.grpo.group_size, : ro.prompt_len][
            ro.attention_mask[i * cfg.grpo.group_size, : ro.prompt_len].bool()].tolist())
        assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}") and prompt.endswith("<|im_start|>assistant\n")
        assert row["question"] in prompt
