"""Would a compiled (fused) decode step close the rollout gap? Eager vs Inductor on one GPT.

The rollout's decode step is ~300 small eager ops around 17 weight matmuls (docs/results/speed.md).
This compiles the same step with ``torch.compile(fullgraph=True, dynamic=False)`` in the form that
compiles to ONE graph per rollout shape: every row's response keys/values in a fixed-size buffer
of ``max_new`` positions (the not-yet-written ones masked), the current token's own key attended
separately, and the cache written outside the graph (a graph that mutates the cache in place
copied the whole buffer back every step: 0.39x). Inductor's ``freezing`` packs the weights for MKL
(``mkl._mkl_linear``); ``--cpp-wrapper`` also drops the Python wrapper.

Same weights, same prompts, greedy decoding on both sides (the tokens are compared), prefill
eager on both; alternating repeats in one process, median seconds. The last line is a JSON object.

    .venv/bin/python bench/compiled_decode.py [--layers 4] [--width 256] [--prompts 8] [--group 8]
        [--prompt-len 64] [--new-tokens 64] [--repeats 5] [--cpp-wrapper]

Measured, not used by the pipeline (docs/results/speed.md, one core): 1.20x (freezing) and 1.26x
(plus the C++ wrapper) over the eager GPT rollout at 4x256, 64 rows; compile 15-49 s per shape.
The step's attention over the response keys reads the whole buffer every step and is memory-bound
in the generated kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_decode_workload_args, alternate, emit, machine_line, median, timed

import torch
import torch.nn.functional as F

from pipeline.model.gpt import GPT, GPTConfig, GPTDecoder, apply_rope


def static_step(model: GPT, B: int, G: int, Tp: int, M: int):
    """One decode step of N = B*G rows as a function of fixed-shape tensors (compilable)."""
    cfg = model.config
    N, H, D, C = B * G, cfg.n_head, cfg.head_dim, cfg.n_embd
    scale = D ** -0.5

    def step(tok, t, kp_t, vp, bias, kr, vr):
        # tok (N,); t: 0-d position in the response; kp_t (L, B, H, D, Tp); vp (L, B, H, Tp, D);
        # bias (B, H, 1, Tp); kr, vr (L, N, H, M, D): response keys/values, positions >= t unwritten
        x = model.wte(tok)[:, None]  # (N, 1, C)
        p = (t + Tp).view(1)
        cos = model.rope_cos.index_select(0, p).view(1, 1, 1, D)
        sin = model.rope_sin_signed.index_select(0, p).view(1, 1, 1, D)
        written = torch.zeros(M).masked_fill(torch.arange(M) >= t, float("-inf"))  # (M,)
        ks, vs = [], []
        for layer, blk in enumerate(model.h):
            q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(C, dim=2)
            q, k, v = (z.view(N, 1, H, D).transpose(1, 2) for z in (q, k, v))  # (N, H, 1, D)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            ks.append(k)
            vs.append(v)
            qg = q.reshape(B, G, H, D).transpose(1, 2).reshape(B * H, G, D)
            sp = torch.baddbmm(bias.reshape(B * H, 1, Tp), qg, kp_t[layer].reshape(B * H, D, Tp), alpha=scale)
            sp = sp.view(B, H, G, Tp).transpose(1, 2).reshape(N, H, 1, Tp)
            sr = (q @ kr[layer].transpose(-1, -2)) * scale + written  # (N, H, 1, M)
            ss = (q * k).sum(-1, keepdim=True) * scale  # (N, H, 1, 1): the new token's own key
            ap, ar, aself = torch.cat([sp, sr, ss], -1).softmax(-1).split([Tp, M, 1], -1)
            yp = ap.reshape(B, G, H, Tp).transpose(1, 2).reshape(B * H, G, Tp) @ vp[layer].reshape(B * H, Tp, D)
            y = yp.view(B, H, G, D).transpose(1, 2).reshape(N, H, 1, D) + ar @ vr[layer] + aself * v
            x = x + blk.attn.c_proj(y.transpose(1, 2).reshape(N, 1, C))
            gate, up = blk.mlp.c_fc(blk.ln_2(x)).split(blk.mlp.hidden, -1)
            x = x + blk.mlp.c_proj(F.silu(gate) * up)
        return model.lm_head(model.ln_f(x))[:, 0], torch.stack(ks), torch.stack(vs)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_decode_workload_args(ap)  # bench/rollout.py's workload
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpp-wrapper", action="store_true", help="Inductor's C++ wrapper (no Python per kernel call)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights as constants: packed for MKL, folded
    inductor_config.cpp_wrapper = args.cpp_wrapper
    print(machine_line(args.threads))

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, n_layer=args.layers, n_head=args.heads, n_embd=args.width)).eval()
    model.requires_grad_(False)
    B, G, Tp, M, L = args.prompts, args.group, args.prompt_len, args.new_tokens, args.layers
    N, H, D = B * G, args.heads, model.config.head_dim
    ids = torch.randint(0, 2048, (B, Tp))
    mask = torch.ones(B, Tp, dtype=torch.long)
    pos = torch.arange(Tp).expand(B, Tp)

    def eager() -> torch.Tensor:
        dec = GPTDecoder(model, Tp + M)
        with torch.inference_mode():
            tok = dec.prefill(ids, mask, pos, G).argmax(-1)
            out = [tok]
            for s in range(M - 1):
                tok = dec.step(tok, torch.full((N,), Tp + s)).argmax(-1)
                out.append(tok)
        return torch.stack(out, 1)

    step = static_step(model, B, G, Tp, M)

    def run_static(fn) -> torch.Tensor:
        dec = GPTDecoder(model, Tp + M)
        with torch.inference_mode():
            tok = dec.prefill(ids, mask, pos, G).argmax(-1)
            P = dec.cache.prefix
            kp_t, vp, bias = dec.cache.prefix_k_t, P.v[:, :, :, :Tp].contiguous(), dec.cache.prefix_bias
            kr, vr = torch.zeros(L, N, H, M, D), torch.zeros(L, N, H, M, D)
            out = [tok]
            for s in range(M - 1):
                logits, k, v = fn(tok, torch.tensor(s), kp_t, vp, bias, kr, vr)
                kr[:, :, :, s], vr[:, :, :, s] = k[:, :, :, 0], v[:, :, :, 0]
                tok = logits.argmax(-1)
                out.append(tok)
        return torch.stack(out, 1)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    reference = eager()
    same_static = torch.equal(run_static(step), reference)
    compile_s, tokens = timed(lambda: run_static(compiled))
    same_compiled = torch.equal(tokens, reference)
    times = alternate({"eager": eager, "compiled": lambda: run_static(compiled)}, args.repeats, warm_up=False)
    e, c = median(times["eager"]), median(times["compiled"])
    print(f"GPT {L}x{args.width}, {B} prompts x {G}, {Tp} prompt + {M} new tokens, greedy")
    print(f"first compiled rollout (compile included): {compile_s:.1f} s; same tokens as eager: "
          f"static form {same_static}, compiled {same_compiled}")
    print(f"eager {e:.3f} s ({e / M * 1e3:.2f} ms/step), compiled {c:.3f} s ({c / M * 1e3:.2f} ms/step): "
          f"{e / c:.2f}x")
    emit({"eager_s": e, "compiled_s": c, "speedup": e / c, "compile_s": compile_s, "same_tokens": same_compiled,
          "cpp_wrapper": args.cpp_wrapper, "layers": L, "width": args.width, "rows": N, "new_tokens": M})


if __name__ == "__main__":
    main()
