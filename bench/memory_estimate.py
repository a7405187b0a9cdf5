"""Estimated peak GPU memory of each phase of a GRPO stage, from the model's shape and the params.

    python bench/memory.py --params configs/instruct.yaml [--size 0.5B|1.5B|3B|7B | --hf-config DIR]
                           [--prompt-tokens 200] [--set grpo.micro_batch_size=4 ...]

One GPU, one process (under DDP each rank holds the same weights and a 1/nproc share of the
rows; under `parallel: fsdp` each rank holds a 1/nproc shard of the weights, the reference, the
gradients and AdamW's moments, plus a whole copy of the weights to sample from, and a pass gathers
the root's weights (embeddings, final norm, head) and one block at a time with the next prefetched;
autocast's bf16 copy is still counted whole). Bytes counted, per phase (G rows per prompt,
N = prompts_per_iter * G rows, T = prompt + rollout tokens, m = micro_batch_size or the minibatch's rows):

- static: policy weights (param_dtype), the frozen reference (a second copy; none under LoRA,
  which disables the adapters instead), gradients (in the weights' dtype) and two fp32 AdamW
  moments of what trains (all weights, or the adapters, which peft keeps in fp32), with bf16
  weights their fp32 master copy (`pipeline.train.optim.MasterAdamW`: 2 + 2 + 8 + 4 = 16 bytes per
  trained weight, against 4 + 4 + 8 = 16 in fp32: bf16 weights save only the frozen reference's
  half), and under bf16 autocast a bf16 copy of fp32 weights that autocast caches for backward;
- rollout: the KV cache (the prompts' keys once per group, each row's response keys) in bf16,
  and the sampler's fp32 (N, V) buffers (logits, probabilities, a CDF);
- logprobs: one micro-batch's logits (m, T - prompt, V; bf16 under autocast), a 128 MB fp32 chunk, one layer's
  activations (inference mode keeps nothing else);
- update: the micro-batch's logits kept for backward and their gradient (each in the logits' dtype), the
  activations autograd keeps per layer (:func:`layer_activation_bytes`, what a Qwen2/Llama layer's
  backward saves, measured with saved-tensor hooks in tests/test_memory_estimate.py: under bf16
  autocast (7 d + 4 ffn + 2 kv_dim) bf16 values per token plus 4 d fp32 ones, the RMSNorms'
  inputs and normalised outputs, which transformers computes in fp32; in fp32 (8 d + 4 ffn +
  2 kv_dim) fp32 values; a flash/SDPA attention keeps no T x T matrix), or with gradient
  checkpointing the residual stream at each layer's input (fp32 with fp32 weights, also under
  autocast) plus one layer's activations recomputed;
- evaluate: the rollout of `evaluate.batch_size` prompts, one completion each.

An estimate (allocator overhead and fragmentation add ~5-15%); bench/device_check.sh measures
the peak of a real run beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass
class Shape:
    """The transformer's sizes (a Qwen2/Llama-style decoder: GQA attention, SwiGLU MLP)."""

    layers: int
    d: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def params(self) -> int:
        attn = 2 * self.d * self.d + 2 * self.d * self.kv_dim + self.d + 2 * self.kv_dim  # q, o, k, v (+ biases)
        per_layer = attn + 3 * self.d * self.ffn + 2 * self.d
        return self.layers * per_layer + self.vocab * self.d * (1 if self.tied else 2) + self.d

    def lora_params(self, rank: int, targets: list[str]) -> int:
        dims = {"q_proj": (self.d, self.d), "k_proj": (self.d, self.kv_dim), "v_proj": (self.d, self.kv_dim),
                "o_proj": (self.d, self.d), "gate_proj": (self.d, self.ffn), "up_proj": (self.d, self.ffn),
                "down_proj": (self.ffn, self.d)}
        return self.layers * sum(rank * (i + o) for t, (i, o) in dims.items() if t in targets)


# Qwen2.5 (instruct) shapes from their published config.json files
SIZES = {
    "0.5B": Shape(24, 896, 4864, 14, 2, 151936, True),
    "1.5B": Shape(28, 1536, 8960, 12, 2, 151936, True),
    "3B": Shape(36, 2048, 11008, 16, 2, 151936, True),
    "7B": Shape(28, 3584, 18944, 28, 4, 152064, False),
}


def shape_from_hf_config(folder: str | Path) -> Shape:
    c = json.loads((Path(folder) / "config.json").read_text())
    return Shape(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                 c.get("num_key_value_heads", c["num_attention_heads"]), c["vocab_size"],
                 bool(c.get("tie_word_embeddings", False)))


def shape_from_gpt(model, vocab: int) -> Shape:
    """The from-scratch GPT of the gpt backend (MHA, SwiGLU with ffn = 4 d, tied head)."""
    return Shape(model.n_layer, model.n_embd, 4 * model.n_embd, model.n_head, model.n_head, vocab, True)


def layer_activation_bytes(shape: Shape, autocast: bool) -> int:
    """Bytes one decoder layer's backward keeps per token: under bf16 autocast the q/k/v heads
    (d + 2 kv_dim), six d-wide bf16 inputs and outputs of the attention and MLP matmuls, four
    ffn-wide MLP activations, and the two RMSNorms' fp32 inputs and normalised outputs (4 d fp32);
    in fp32 the same tensors without the casts (8 d + 4 ffn + 2 kv_dim fp32 values)."""
    d, ffn, kv = shape.d, shape.ffn, shape.kv_dim
    if autocast:
        return 2 * (7 * d + 4 * ffn + 2 * kv) + 4 * (4 * d)
    return 4 * (8 * d + 4 * ffn + 2 * kv)


def sharded(stage_conf) -> bool:
    """The stage shards its model over ranks (`parallel: fsdp` with more than one)."""
    return stage_conf.parallel == "fsdp" and stage_conf.nproc > 1


def estimate(cfg, shape: Shape, prompt_tokens: int, stage: str = "grpo") -> dict[str, float]:
    """Peak bytes per phase (see the module docstring) for `cfg` (a pipeline Config)."""
    g, m, e = getattr(cfg, stage), cfg.model, cfg.evaluate
    P, wb = shape.params(), (2 if m.param_dtype == "bfloat16" else 4)
    lora = m.lora_rank > 0
    trainable = shape.lora_params(m.lora_rank, m.lora_targets) if lora else P
    autocast = m.dtype != "float32"  # `auto` is bf16 autocast on a GPU, what this estimates
    autocast_copy = 2 * P if (wb == 4 and autocast) else 0
    weights = P * wb + (0 if lora or g.kl_coef == 0 else P * wb)
    grad_b, master = (4, 0) if lora or wb == 4 else (2, 4)  # peft's adapters are fp32; bf16: fp32 masters
    train_state = trainable * (grad_b + 8 + master)  # gradients, two fp32 AdamW moments, masters
    shards = g.nproc if sharded(g) else 1
    root = shape.vocab * shape.d * (1 if shape.tied else 2) + shape.d  # embeddings, head, final norm
    # fsdp: each rank's shards, the sampler's whole copy, and what a pass gathers (the root, two blocks)
    static = (weights + train_state) / shards + (P * wb if shards > 1 else 0)
    gathered = (root + 2 * (P - root) // shape.layers) * wb if shards > 1 else 0
    rows, R = g.prompts_per_iter * g.group_size // max(g.nproc, 1), g.rollout_len
    T, V, L = prompt_tokens + R, shape.vocab, shape.layers
    kv = lambda prompts, n, r: L * 2 * shape.kv_dim * 2 * (prompts * prompt_tokens + n * r)  # bf16 keys + values
    mb_rows = g.micro_batch_size or (g.minibatch_groups * g.group_size if g.minibatch_groups else rows)
    layer_act = mb_rows * T * layer_activation_bytes(shape, autocast)
    logit_b = 2 if autocast or wb == 2 else 4
    logits = mb_rows * R * V * logit_b  # the response columns only (the prompt's vocabulary projection is skipped)
    kept = L * mb_rows * T * shape.d * wb + layer_act if m.gradient_checkpointing else L * layer_act
    return {
        "params": P, "trainable": trainable,
        "static": static,
        "rollout": static + kv(rows // g.group_size, rows, R) + 3 * rows * V * 4,
        "logprobs": static + gathered + logits + (1 << 27) + layer_act,
        "update": static + gathered + autocast_copy + 2 * logits + (1 << 27) + kept,
        "evaluate": P * wb + kv(e.batch_size, e.batch_size, e.max_new_tokens) + 3 * e.batch_size * V * 4,
    }


def report(cfg, shape: Shape, prompt_tokens: int, label: str) -> dict:
    est = estimate(cfg, shape, prompt_tokens)
    g, m = cfg.grpo, cfg.model
    print(f"model {label}: {est['params'] / 1e9:.2f}B params ({est['trainable'] / 1e6:.1f}M trained"
          f"{', LoRA r=' + str(m.lora_rank) if m.lora_rank else ''}), weights {m.param_dtype}, "
          f"grpo: {g.prompts_per_iter} prompts x {g.group_size}, rollout {g.rollout_len}, prompt ~{prompt_tokens} "
          f"tokens, micro_batch_size {g.micro_batch_size or 'whole minibatch'}, "
          f"gradient checkpointing {'on' if m.gradient_checkpointing else 'off'}"
          f"{f', fsdp over {g.nproc} ranks (per rank)' if sharded(g) else ''}")
    peak = max(v for k, v in est.items() if k not in ("params", "trainable", "static"))
    for phase in ("static", "rollout", "logprobs", "update", "evaluate"):
        print(f"  {phase:9s} {est[phase] / GB:7.1f} GB")
    for card in (80, 141):
        verdict = "fits" if peak * 1.1 <= card * GB else "does NOT fit"
        print(f"  one {card} GB card: peak {peak / GB:.1f} GB (+10% allocator) {verdict}")
    return {"bench": "memory_estimate", "model": label, **{k: round(v / GB, 2) for k, v in est.items()
                                                            if k not in ("params", "trainable")},
            "params": est["params"], "trainable": est["trainable"], "peak_gb": round(peak / GB, 2)}
