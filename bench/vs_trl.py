"""Seconds per GRPO iteration: TRL's GRPOTrainer vs our GRPO stage (HF backend), same model, same workload.

Workload (both sides): one randomly initialised GPT-2 (4 layers x 256, vocab 2048 BPE, built from a
config and saved to a temp folder with a HF tokenizer made from our BPE), 8 prompts x 8
generations, exactly 32 completion tokens (TRL: ``min_new_tokens=32``; ours: no stop tokens),
temperature 1.0, beta = kl_coef = 0.04 (so both run a reference forward), clip 0.2, one update
pass (TRL ``num_iterations=1``: old log-probs = new.detach() on both), token-mean loss (TRL
``loss_type="dapo"``), per-group reward scaling, AdamW lr 2e-5, CPU, fp32, no vLLM, no
checkpoints (TRL ``save_strategy="no"``, ``report_to="none"``), no gradient checkpointing (TRL's
default is on; ours has none, so it is turned off for a like-for-like figure). Reward on both sides: our
verifier (``reward_for("arith")``) on 8 arithmetic prompts (the whole dataset, so every iteration
uses all 8 on both sides).

Alternation: TRL's training loop drives; a callback runs ONE of our iterations after each TRL step
(not counted in TRL's time), so machine load drifts hit both alike. TRL's time per step is the
wall time between consecutive ``on_step_end`` calls minus our iteration, i.e. everything TRL does
per step. The first step of each is a warm-up and dropped.

    make bench-venv && .venv-bench/bin/python bench/vs_trl.py [--repeats 3] [--threads 1] [--ab-shared-prefix]

The last line printed is a JSON object with ``trl_s``, ``ours_s`` and ``speedup`` (trl_s / ours_s).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GRPOIterations, arith_rows, emit, load_avg, median, synthetic_corpus, workdir, write_rows

import torch

PROMPTS, GROUP, NEW_TOKENS, BETA, CLIP, LR = 8, 8, 32, 0.04, 0.2, 2e-5


def build_model(folder: Path, layers: int, width: int) -> tuple[int, object]:
    """Save a random GPT-2 + HF tokenizer to `folder`; return (param count, our BPE tokenizer)."""
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from pipeline.tokenizer import EOS, PAD, train_tokenizer

    bpe = train_tokenizer(synthetic_corpus(), vocab_size=2048)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=bpe.vocab_size, n_positions=512, n_embd=width, n_layer=layers, n_head=4,
                     bos_token_id=bpe.eos_id, eos_token_id=bpe.eos_id, pad_token_id=bpe.pad_id)
    model = GPT2LMHeadModel(cfg)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token=PAD, eos_token=EOS)
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()), bpe


def ours_trainer(model_dir: Path, data: list[dict]):
    """Our GRPO stage's iterations on the HF backend, in the cwd (data/ and checkpoints/ written here)."""
    from pipeline.checkpoint import save_policy
    from pipeline.config import CHECKPOINT_DIR, config_from_dict
    from pipeline.model.policy import build_policy
    from pipeline import group_sampling

    write_rows(data)
    model = {"backend": "hf", "init": str(model_dir), "device": "cpu", "dtype": "float32"}
    cfg = config_from_dict({
        "model": model, "tracking": {"enabled": False},
        "grpo": {"iterations": 1000, "prompts_per_iter": PROMPTS, "group_size": GROUP, "rollout_len": NEW_TOKENS,
                 "temperature": 1.0, "kl_coef": BETA, "clip": CLIP, "grpo_epochs": 1, "minibatch_groups": 0,
                 "lr": LR, "weight_decay": 0.0, "loss_agg": "token-mean", "adv_norm": "group", "eval_every": 0},
    }, "vs_trl")
    policy = build_policy(cfg.model)
    for name in ("sft", "warmup"):
        save_policy(Path(CHECKPOINT_DIR) / name, policy)
    # exactly NEW_TOKENS per completion, as on the TRL side: no stop tokens
    group_sampling.rollout_prompts = functools.partial(group_sampling.rollout_prompts, stop_ids=[])
    return GRPOIterations(cfg, "grpo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed iterations of each after one warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--ab-shared-prefix", action="store_true",
                    help="also time our iteration with the shared-prompt log-prob path off (an extra arm after ours)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.model.policy import Policy
    from pipeline.rewards.verifiers import reward_for

    verifier = reward_for("arith")

    def reward(completions, gold, **_):
        return [verifier(c, g) for c, g in zip(completions, gold)]

    with workdir() as tmp:
        model_dir = tmp / "model"
        n_params, _ = build_model(model_dir, args.layers, args.width)
        data = arith_rows(PROMPTS)
        ours = ours_trainer(model_dir, data)
        ours_times: list[float] = []
        plain_times: list[float] = []
        trl_marks: list[float] = []

        class Interleave(TrainerCallback):
            def on_step_end(self, a, state, control, **kw):
                trl_marks.append(time.perf_counter())
                t0 = time.perf_counter()
                ours.iteration()
                ours_times.append(time.perf_counter() - t0)
                if args.ab_shared_prefix:  # the same iteration with every group's prompt recomputed per row
                    shared, Policy._shares_prompt = Policy._shares_prompt, lambda *a: False
                    t0 = time.perf_counter()
                    ours.iteration()
                    ours.it += 1
                    plain_times.append(time.perf_counter() - t0)
                    Policy._shares_prompt = shared
                trl_marks.append(time.perf_counter())  # TRL's next step starts now

        config = GRPOConfig(
            output_dir=str(tmp / "trl"), per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1,
            num_generations=GROUP, max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0, top_p=1.0, top_k=0, beta=BETA, epsilon=CLIP, num_iterations=1, loss_type="dapo",
            scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
            max_steps=1 + args.repeats, save_strategy="no", report_to="none", logging_steps=10_000, use_cpu=True,
            bf16=False, fp16=False, seed=0, gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0,
            log_completions=False)
        dataset = Dataset.from_list([{"prompt": r["prompt"], "gold": r["gold"]} for r in data])
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Interleave()])
        torch.set_num_threads(args.threads)  # in case a library changed it
        t_start = time.perf_counter()
        trainer.train()
        starts = [t_start] + trl_marks[1::2][:-1]
        trl_times = [end - start for start, end in zip(starts, trl_marks[0::2])]

    trl_s, ours_s = median(trl_times[1:]), median(ours_times[1:])
    print(f"load {load_avg()}; torch {torch.__version__}, trl {trl.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"GPT-2 {args.layers}x{args.width}, {n_params / 1e6:.2f}M params, {PROMPTS}x{GROUP} completions of "
          f"{NEW_TOKENS} tokens, beta {BETA}, clip {CLIP}, one update per iteration; random init")
    print(f"  TRL GRPOTrainer  {trl_s:7.3f} s/iteration  (warm-up {trl_times[0]:.2f}s; "
          + ", ".join(f"{t:.3f}" for t in trl_times[1:]) + ")")
    print(f"  ours (hf)        {ours_s:7.3f} s/iteration  (warm-up {ours_times[0]:.2f}s; "
          + ", ".join(f"{t:.3f}" for t in ours_times[1:]) + ")")
    print(f"  speedup (TRL / ours): {trl_s / ours_s:.2f}x")
    extra = {}
    if plain_times:
        plain_s = median(plain_times[1:])
        print(f"  ours, prompts recomputed per row {plain_s:7.3f} s/iteration ("
              + ", ".join(f"{t:.3f}" for t in plain_times[1:]) + f"): shared prompts {plain_s / ours_s:.2f}x")
        extra = {"ours_plain_s": round(plain_s, 4), "shared_prefix_speedup": round(plain_s / ours_s, 3),
                 "ours_plain_times": [round(t, 4) for t in plain_times]}
    emit({"bench": "vs_trl", "trl_version": trl.__version__, "transformers_version": transformers.__version__,
          "threads": args.threads, "params": n_params, "trl_s": round(trl_s, 4), "ours_s": round(ours_s, 4),
          "speedup": round(trl_s / ours_s, 3), "trl_times": [round(t, 4) for t in trl_times],
          "ours_times": [round(t, 4) for t in ours_times], **extra})


if __name__ == "__main__":
    main()
