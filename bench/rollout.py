"""Rollout engine throughput vs transformers' ``generate()`` on the same tiny Llama-style model.

Both sides run the SAME ``LlamaForCausalLM`` weights (ours through the pipeline's HF backend, so
this compares decoding engines, not models): 8 prompts x 8 samples = 64 completions, prompts of
64 tokens, exactly 64 new tokens (no stop tokens on either side), temperature 1, no top-k/top-p,
repeats interleaved in one process. Every speed-up is a paired ratio: repeat i of one engine over
repeat i of the other, run back to back, reported as median (min, max) over the repeats.

Arms: ``ours_hf_llama`` (the fused Llama decode step, ``pipeline.model.fast.fused_decode``),
``hf_generate``, ``ours_gpt`` (the from-scratch GPT of the same width/depth),
``ours_hf_module_step`` (the same shared-prefix decoder with each step through the model's own
modules: ``fused_step_speedup``), ``weight_matmuls_only`` (our rollout's weight matmuls alone, on
the packed GEMM the fused step runs them on, oneDNN's where torch has it: what the rollout would
cost with every other op free; ``floor_ratio`` = generate() over it, an estimate of how far ahead of
generate() an fp32 engine with our arithmetic, one prefill per prompt included, could get on this
CPU; ``ours_over_floor``), and the same on MKL's packed GEMM (``weight_matmuls_only_mkl``,
``onednn_floor_speedup`` = MKL's over oneDNN's: the decode matmuls ran on MKL before).
``--bf16``: both engines under bf16 autocast (``ratio_bf16``; slower than fp32 on a CPU without
bf16 kernels: see the ``kernels`` of the first line), and our module-step decoder too
(``ratio_module_step_bf16``: the path of a model with no fused step, e.g. GPT-2).
``--levers``: the earlier per-row StaticCache decoder and unpacked weights as A/B arms, and our rollout
with its packed weights on MKL's GEMM instead of oneDNN's (``ours_hf_mkl``, ``bench.onednn.mkl_packed``:
``onednn_decode_speedup`` = MKL's rollout over ours).

Also the ops dispatched per decode step of each engine (``ops_per_decode_step``: a rollout of 16
new tokens minus one of 8, over 8; load-independent), where our fused step's time goes
(``step_breakdown``: weight matmuls, attention, the rest; fp32, and bf16 with ``--bf16``), and our
engine with the KV cache vs recomputing the whole prefix every step.

    .venv/bin/python bench/rollout.py [--repeats 5] [--bf16] [--levers] [--layers 4] [--width 256] [--init DIR]

``--init DIR``: a real Llama-family model instead of the random one (a Hugging Face folder, e.g. the
SmolLM2 recipe's converted ``recipes/smollm2/model``, fp32 weights; its eos ids switched off on both
sides so every row decodes ``--new-tokens``; prompts are still random token ids of ``--prompt-len``,
the shapes being what the engines are timed on); ``--layers``/``--width``/``--heads`` are then the
model's, and the from-scratch GPT arm (``ours_gpt``, ``ratio_gpt``) is left out.

The last line printed is a JSON object (``ratio`` = generate / ours, with min/median/max).
Nothing is downloaded: the model is built from a config with random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (add_decode_workload_args, alternate, count_aten_ops, fmt_ratios, load_avg,
                          machine_line, median, pair_ratios)
from bench.onednn import mkl_packed
from pipeline.core.config import ModelConfig
from pipeline.data.tokenizer import HFTokenizer
from pipeline.model.fast.packed import MKLWeight, library, mkl_available
from pipeline.model.gpt import GPT, GPTConfig
from pipeline.model.hf import HFDecoder
from pipeline.model.policy import Policy, _Autocasting
import pipeline.rl.rollout as rollout_module
from pipeline.data.tokenizer import EOS, PAD, train_tokenizer
from pipeline.rl.rollout import rollout_prompts


def synthetic_texts(n: int = 3000, seed: int = 0) -> list[str]:
    """Random pseudo-words: enough distinct merges for a full 2048-token BPE vocabulary."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(12)) + f" {rng.randint(0, 999)} = <answer>1</answer>"
            for _ in range(n)]


class NoCacheDecoder:
    """Same interface as the KV-cached decoders, but recomputes every sequence from scratch."""

    def __init__(self, policy: Policy, max_len: int) -> None:
        self.policy = policy

    def prefill(self, input_ids, attention_mask, position_ids, repeats):
        self.ids = input_ids.repeat_interleave(repeats, 0)
        self.mask = attention_mask.repeat_interleave(repeats, 0)
        return self.policy.logits(self.ids, self.mask)[:, -1].float()

    def select(self, rows) -> bool:  # the rollout may drop stopped rows of a greedy batch: keep them all
        return False

    def step(self, tokens, positions):
        self.ids = torch.cat([self.ids, tokens[:, None]], 1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        return self.policy.logits(self.ids, self.mask)[:, -1].float()


def load(init: str):
    """(the real model's policy, None, vocabulary) from a Hugging Face folder (fp32 weights, no eos)."""
    from pipeline.model.hf import load_hf

    llama, tok = load_hf(init)
    llama.eval()
    llama.generation_config.eos_token_id = None  # no stop token: exactly max_new_tokens for generate too
    llama.generation_config.pad_token_id = tok.pad_id
    hf_policy = Policy(llama, tok, ModelConfig(backend="hf", init=str(init), device="cpu"))
    return hf_policy, None, llama.config.vocab_size


def build(layers: int, width: int, heads: int):
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = train_tokenizer(synthetic_texts(), vocab_size=2048)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), pad_token=PAD, eos_token=EOS)
    V = bpe.vocab_size
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=bpe.pad_id, bos_token_id=None, eos_token_id=None)
    llama = LlamaForCausalLM(cfg).eval()
    llama.generation_config.eos_token_id = None  # no stop token: exactly max_new_tokens for generate too
    llama.generation_config.pad_token_id = bpe.pad_id
    hf_policy = Policy(llama, HFTokenizer(hf_tok), ModelConfig(backend="hf", init="bench", device="cpu"))
    gpt = GPT(GPTConfig(vocab_size=V, n_layer=layers, n_head=heads, n_embd=width, block_size=512))
    gpt_policy = Policy(gpt, bpe, ModelConfig(n_layer=layers, n_head=heads, n_embd=width, device="cpu")).eval()
    return hf_policy, gpt_policy, V


def on_mkl(run):
    """`run` (a rollout) with the weights the fused step and the module path pack
    (``pipeline.model.fast.packed``) on MKL's packed GEMM instead of oneDNN's: the ``ours_hf_mkl`` arm
    (:func:`bench.onednn.mkl_packed`)."""
    def wrapped():
        with mkl_packed():
            run()
    return wrapped


def weight_matmuls_only(llama, prompts: int, prompt_len: int, rows: int, new_tokens: int, gemm: str = "pipeline"):
    """Our rollout's weight matmuls and nothing else: the prefill's (every layer's q/k/v, o, gate/up and
    down weights on the B x Tp prompt tokens, the LM head on the B last ones) and each decode step's
    (the same weights and the head on all N rows, for the new_tokens - 1 steps after the prefill), on
    the packed GEMM the fused step runs them on (`gemm` "pipeline"; packed outside the timed calls, the
    same inputs each step) or on MKL's (`gemm` "mkl", :class:`pipeline.model.fast.packed.MKLWeight`). No attention,
    norms, sampling or bookkeeping: what the rollout would cost with every other op free. It is an
    estimate, not a bound: generate() prefills all B x G rows where ours prefills each prompt once,
    so ``floor_ratio`` includes that saving (bench/tests/test_rollout_floor.py checks the FLOPs equal
    our engine's)."""
    from pipeline.model.fast.fused_decode import _Layer, _Linear  # the fused step's own fused, packed weights

    def on(f: _Linear, n: int):
        return f if gemm == "pipeline" else MKLWeight(f.weight, f.bias, n)

    def layer_linears(n: int):  # every layer's weights, packed for n-row calls as the fused step packs them
        fns = [on(f, n) for layer in llama.model.layers for L in [_Layer(layer, n)]
               for f in (L.qkv, L.o, L.gate_up, L.down)]
        xs = {f.weight.shape[1]: torch.randn(n, f.weight.shape[1]) for f in fns}
        return lambda: [f(xs[f.weight.shape[1]]) for f in fns]

    def head_linear(n: int):
        head = on(_Linear(llama.lm_head.weight, llama.lm_head.bias, n), n)
        x = torch.randn(n, head.weight.shape[1])
        return lambda: head(x)

    prefill, prefill_head = layer_linears(prompts * prompt_len), head_linear(prompts)
    step_layers, step_head = layer_linears(rows), head_linear(rows)

    def step():
        step_layers()
        step_head()

    def run():
        with torch.inference_mode():
            prefill()
            prefill_head()
            for _ in range(new_tokens - 1):
                step()
    return run


def step_breakdown(policy: Policy, run) -> dict[str, float]:
    """Where a decode step of the fused step goes, from one call of `run` (a rollout of `policy`):
    seconds per step in the weight matmuls (every ``fused_decode._Linear`` call), in the attention
    (every ``grouped_prefix_attention`` call), and the rest of the step (norms, rotary, embedding,
    cache writes; not the sampling between steps). Timers around each call: a few microseconds each."""
    import pipeline.model.fast.fused_decode as fused_decode

    acc = {"linears": 0.0, "attention": 0.0, "step": 0.0}
    steps = [0]
    linear_call, attention = fused_decode._Linear.__call__, fused_decode.grouped_prefix_attention
    make_decoder = policy.decoder

    def timed(fn, key):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            acc[key] += time.perf_counter() - start
            return out
        return wrapper

    def decoder(max_len):
        dec = make_decoder(max_len)
        step = dec.step

        def timed_step(*a, **kw):
            steps[0] += 1
            return timed(step, "step")(*a, **kw)
        dec.step = timed_step
        return dec

    own = policy.__dict__.get("decoder")  # an instance's own decoder factory, else the class's method
    fused_decode._Linear.__call__ = timed(linear_call, "linears")
    fused_decode.grouped_prefix_attention = timed(attention, "attention")
    policy.decoder = decoder
    try:
        run()
    finally:
        fused_decode._Linear.__call__, fused_decode.grouped_prefix_attention = linear_call, attention
        if own is None:
            del policy.decoder
        else:
            policy.decoder = own
    if not acc["linears"]:
        raise RuntimeError("the rollout did not run the fused decode step")
    n = steps[0]
    return {"step_ms": 1e3 * acc["step"] / n, "linears": acc["linears"] / acc["step"],
            "attention": acc["attention"] / acc["step"],
            "rest": (acc["step"] - acc["linears"] - acc["attention"]) / acc["step"]}


def ops_per_step(make_run, n: int = 8) -> float:
    """Ops dispatched per decode step (bench.common.count_aten_ops): a rollout of 2n new tokens minus
    one of n, over n; the prefill and the per-rollout set-up cancel out."""
    return (count_aten_ops(make_run(2 * n)) - count_aten_ops(make_run(n))) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    add_decode_workload_args(ap)
    ap.add_argument("--no-cache-new-tokens", type=int, default=8,
                    help="new tokens for the cache vs no-cache comparison (recomputing is slow)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a small CPU shared with other jobs more threads thrash)")
    ap.add_argument("--bf16", action="store_true", help="also both engines under bf16 autocast")
    ap.add_argument("--levers", action="store_true",
                    help="also the earlier engines (per-row StaticCache decoder, unpacked weights) as A/B arms")
    ap.add_argument("--init", default=None, metavar="DIR",
                    help="a real Llama-family Hugging Face folder instead of the random model (no GPT arm)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    hf_policy, gpt_policy, V = load(args.init) if args.init else build(args.layers, args.width, args.heads)
    if args.init:
        c = hf_policy.module.config
        args.layers, args.width, args.heads = c.num_hidden_layers, c.hidden_size, c.num_attention_heads
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, V, (args.prompts, args.prompt_len), generator=g)
    prompt_list = prompt_ids.tolist()
    n_tokens = args.prompts * args.group * args.new_tokens
    llama = hf_policy.module

    def ours(policy, new_tokens=args.new_tokens):
        def run():
            r = rollout_prompts(policy, None, args.group, new_tokens, generator=torch.Generator().manual_seed(1),
                                stop_ids=[], prompt_ids=prompt_list)
            assert int(r.response_lengths.sum()) == args.prompts * args.group * new_tokens
        return run

    def unpacked(run):
        """The same rollout with the per-call F.linear instead of the weights packed once (the A/B arm)."""
        def wrapped():
            orig = rollout_module.packed_linears
            rollout_module.packed_linears = lambda module, rows, enabled=True: orig(module, rows, enabled=False)
            try:
                run()
            finally:
                rollout_module.packed_linears = orig
        return wrapped

    def hf_generate(new_tokens=args.new_tokens, dtype=None):
        def run():
            torch.manual_seed(1)
            with torch.inference_mode(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = llama.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                     num_return_sequences=args.group,
                                     pad_token_id=hf_policy.tokenizer.pad_id)
            assert out.shape == (args.prompts * args.group, args.prompt_len + new_tokens)
        return run

    def variant(make_decoder, dtype: str = "float32") -> Policy:
        cfg = ModelConfig(backend="hf", init="bench", device="cpu", dtype=dtype)
        pol = Policy(llama, hf_policy.tokenizer, cfg)
        if make_decoder is not None:
            pol.decoder = lambda max_len: _Autocasting(make_decoder(max_len), pol)
        return pol

    def module_decoder(max_len):  # each step through the model's own modules
        return HFDecoder(llama, max_len, fused=False)

    module_step = variant(module_decoder)
    runs = {"ours_hf_llama": ours(hf_policy), "hf_generate": hf_generate(),
            **({"ours_gpt": ours(gpt_policy)} if gpt_policy is not None else {}),
            "ours_hf_module_step": ours(module_step),
            "weight_matmuls_only": weight_matmuls_only(llama, args.prompts, args.prompt_len,
                                                       args.prompts * args.group, args.new_tokens)}
    onednn = library() == "onednn" and mkl_available()  # the pipeline packs for oneDNN; MKL as the A/B arm
    if onednn:
        runs["weight_matmuls_only_mkl"] = weight_matmuls_only(llama, args.prompts, args.prompt_len,
                                                              args.prompts * args.group, args.new_tokens, "mkl")
    if args.bf16:
        runs |= {"ours_hf_bf16": ours(variant(None, "bfloat16")), "hf_generate_bf16": hf_generate(dtype=torch.bfloat16),
                 "ours_hf_module_step_bf16": ours(variant(module_decoder, "bfloat16"))}
    if args.levers:
        runs |= {"ours_hf_static_cache": ours(variant(lambda max_len: HFDecoder(llama, max_len, shared_prefix=False))),
                 "ours_hf_unpacked": unpacked(ours(hf_policy))}
        if gpt_policy is not None:
            runs["ours_gpt_unpacked"] = unpacked(ours(gpt_policy))
        if onednn:
            runs["ours_hf_mkl"] = on_mkl(ours(hf_policy))
    print(machine_line(args.threads))
    times = alternate(runs, args.repeats)
    ops = {"ours_hf_llama": ops_per_step(lambda n: ours(hf_policy, n)),
           "ours_hf_module_step": ops_per_step(lambda n: ours(module_step, n)), "hf_generate": ops_per_step(hf_generate)}
    if gpt_policy is not None:
        ops["ours_gpt"] = ops_per_step(lambda n: ours(gpt_policy, n))
    breakdown = {"fp32": step_breakdown(hf_policy, ours(hf_policy))}
    if args.bf16:
        bf16_policy = variant(None, "bfloat16")
        breakdown["bf16"] = step_breakdown(bf16_policy, ours(bf16_policy))
    no_cache = Policy(llama, hf_policy.tokenizer, hf_policy.model_cfg)
    no_cache.decoder = lambda max_len: NoCacheDecoder(no_cache, max_len)
    short = alternate({"cache": ours(hf_policy, args.no_cache_new_tokens),
                       "no_cache": ours(no_cache, args.no_cache_new_tokens)}, 1, warm_up=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.init + ': ' if args.init else ''}Llama {args.layers}x{args.width}, "
          f"vocab {V}, {args.prompts}x{args.group} completions, prompt {args.prompt_len}, new {args.new_tokens}; "
          f"after the runs: load {load_avg()}")
    for name, ts in times.items():
        print(f"  {name:26s} {n_tokens / median(ts):10.0f} tok/s  (" + ", ".join(f"{t:.3f}s" for t in ts) + ")"
              + (f"  {ops[name]:.0f} ops/decode step" if name in ops else ""))
    pairs = {"ratio": ("hf_generate", "ours_hf_llama"),
             **({"ratio_gpt": ("hf_generate", "ours_gpt")} if gpt_policy is not None else {}),
             "fused_step_speedup": ("ours_hf_module_step", "ours_hf_llama"),
             "floor_ratio": ("hf_generate", "weight_matmuls_only"),
             "ours_over_floor": ("ours_hf_llama", "weight_matmuls_only")}
    if onednn:
        pairs |= {"onednn_floor_speedup": ("weight_matmuls_only_mkl", "weight_matmuls_only")}
    if args.bf16:
        pairs |= {"ratio_bf16": ("hf_generate_bf16", "ours_hf_bf16"), "bf16_speedup": ("ours_hf_llama", "ours_hf_bf16"),
                  "ratio_module_step_bf16": ("hf_generate_bf16", "ours_hf_module_step_bf16")}
    if args.levers:
        pairs |= {"shared_prefix_speedup": ("ours_hf_static_cache", "ours_hf_llama"),
                  "packed_linear_speedup_hf": ("ours_hf_unpacked", "ours_hf_llama")}
        if gpt_policy is not None:
            pairs["packed_linear_speedup_gpt"] = ("ours_gpt_unpacked", "ours_gpt")
        if onednn:
            pairs |= {"onednn_decode_speedup": ("ours_hf_mkl", "ours_hf_llama")}
    result = {"model": args.init or "llama-random", "ours_tok_s": round(n_tokens / median(times["ours_hf_llama"]), 1),
              "hf_generate_tok_s": round(n_tokens / median(times["hf_generate"]), 1)}
    for key, (slow, fast) in pairs.items():
        result[key] = pair_ratios(times, slow, fast)
        print(f"  {key:26s} {fmt_ratios(result[key])}  ({slow} / {fast}, paired over {args.repeats} repeats)")
    for dtype, b in breakdown.items():
        print(f"  decode step, ours (HF backend), {dtype}: {b['step_ms']:.2f} ms: weight matmuls {b['linears']:.0%}, "
              f"attention {b['attention']:.0%}, the rest {b['rest']:.0%}")
    speedup = short["no_cache"][0] / short["cache"][0]
    print(f"  ours with KV cache vs recomputing the prefix ({args.no_cache_new_tokens} new tokens): {speedup:.2f}x")
    result |= {"ops_per_decode_step": {k: round(v, 1) for k, v in ops.items()},
               "step_breakdown": {k: {n: round(x, 3) for n, x in b.items()} for k, b in breakdown.items()},
               "cache_speedup": round(speedup, 3),
               "no_cache_new_tokens": args.no_cache_new_tokens, "repeats": args.repeats}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
