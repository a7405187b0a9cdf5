"""Are the gradients of a compiled policy finite and equal to eager ones, on left-padded rows?

    python bench/compiled_grads.py MODEL_DIR [--device auto] [--dtype auto] [--backend inductor]
                                   [--rows 8] [--width 96] [--start 48] [--pad-step 4] [--mask policy|2d]
                                   [--seed 0]

MODEL_DIR: a Hugging Face model folder (bench/tiny_instruct.py makes one), or `gpt` for a random
from-scratch GPT (4 x 128, 8,192-row vocabulary). One batch of random token ids, row i left-padded
by `pad_step`*i columns (so the pad positions' queries see no real key: the case where attention
kernels differ on fully masked rows; 0: no padding), goes through `Policy.token_logprobs` under
grad, the summed response log-probs are backpropagated, once through the module (eager) and once
through `torch.compile(module, backend=...)` with `model.compile` on (bucketed widths, as a
compiled run does). `--mask policy` (default): the model gets the mask the policy gives it
(`pipeline.model.hf_mask.self_attending_mask`: 4-D, every query sees itself); `--mask 2d`: the 2-D
padding mask, from which transformers builds one whose left pads' rows are empty. Printed: whether
the log-probs and every gradient are finite in each mode, the largest differences between the
modes, and the number of dimensions of the mask the model got. The last line is a JSON object.
bench/device_check.sh runs it on a GPU (docs/results/speed.md, "How fast is a GRPO iteration on a
GPU?", says what it showed there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.core.config import ModelConfig  # noqa: E402
from pipeline.model import hf  # noqa: E402
from pipeline.model.policy import build_policy  # noqa: E402


GPT_VOCAB = 8192
ID_LIMIT = 2000  # token ids drawn below this: inside any vocabulary the bench meets (tiny_instruct's has 2,048)


def grads(policy, ids, mask, start):
    policy.module.zero_grad(set_to_none=True)
    lp = policy.token_logprobs(ids, mask, 1.0, start=start, group_size=1)  # (B, T), 0 before `start`
    loss = (lp.float() * mask).sum()
    loss.backward()
    g = {n: p.grad.detach().float().clone() for n, p in policy.module.named_parameters() if p.grad is not None}
    return lp.detach().float(), loss.detach(), g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--start", type=int, default=48, help="first response column (the prompt's width)")
    ap.add_argument("--pad-step", type=int, default=4, help="row i is left-padded by pad_step * i columns")
    ap.add_argument("--mask", default="policy", choices=["policy", "2d"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.pad_step < 0 or args.pad_step * (args.rows - 1) >= args.start:
        ap.error("--start must exceed the widest left padding, pad_step * (rows - 1), and pad_step be >= 0")
    if args.mask == "2d":
        hf.self_attending_mask = lambda model, mask: mask

    torch.manual_seed(args.seed)
    if args.model == "gpt":
        class _Vocab:  # the GPT needs only a vocabulary size and a pad id
            vocab_size, pad_id = GPT_VOCAB, 0

        cfg = ModelConfig(backend="gpt", n_layer=4, n_head=4, n_embd=128, block_size=256, device=args.device,
                          dtype=args.dtype)
        policy = build_policy(cfg, _Vocab())
    else:
        cfg = ModelConfig(backend="hf", init=args.model, device=args.device, dtype=args.dtype)
        policy = build_policy(cfg)
    dev = policy.device
    ids = torch.randint(0, ID_LIMIT, (args.rows, args.width), device=dev)
    mask = torch.ones(args.rows, args.width, dtype=torch.long, device=dev)
    for i in range(args.rows):
        mask[i, : args.pad_step * i] = 0

    mask_ndims = []  # of the attention mask the model gets, in the eager pass
    hook = policy.module.register_forward_pre_hook(
        lambda module, a, kw: mask_ndims.append(kw.get("attention_mask", a[1] if len(a) > 1 else None).ndim),
        with_kwargs=True)
    lp_e, loss_e, g_e = grads(policy, ids, mask, args.start)
    hook.remove()
    policy.model_cfg = dataclasses.replace(cfg, compile=True)
    policy.runner = torch.compile(policy.module, backend=args.backend)
    lp_c, loss_c, g_c = grads(policy, ids, mask, args.start)

    def finite(lp, g):
        bad = sorted(n for n, t in g.items() if not bool(torch.isfinite(t).all()))
        return bool(torch.isfinite(lp).all()), bad

    lp_ok_e, bad_e = finite(lp_e, g_e)
    lp_ok_c, bad_c = finite(lp_c, g_c)
    both = torch.isfinite(lp_e) & torch.isfinite(lp_c)
    lp_diff = float((lp_e - lp_c)[both].abs().max()) if bool(both.any()) else float("nan")
    g_diff = max((float((g_e[n] - g_c[n]).abs().max() / g_e[n].abs().max().clamp_min(1e-12))
                  for n in g_e if n in g_c and n not in bad_e and n not in bad_c), default=float("nan"))
    print(f"device {dev}, dtype {args.dtype}, backend {args.backend}, torch {torch.__version__}; "
          f"{args.rows} rows x {args.width}, left padding 0..{args.pad_step * (args.rows - 1)}, "
          f"mask {args.mask} ({mask_ndims[0]}-D)")
    print(f"eager:    log-probs finite {lp_ok_e}, loss {float(loss_e):.6g}, non-finite gradients {len(bad_e)} "
          f"of {len(g_e)}" + (f" (first: {bad_e[0]})" if bad_e else ""))
    print(f"compiled: log-probs finite {lp_ok_c}, loss {float(loss_c):.6g}, non-finite gradients {len(bad_c)} "
          f"of {len(g_c)}" + (f" (first: {bad_c[0]})" if bad_c else ""))
    print(f"largest |eager - compiled|: log-prob {lp_diff:.3g}; gradient, relative to its tensor's max {g_diff:.3g}")
    print(json.dumps({"bench": "compiled_grads", "model": args.model, "device": str(dev), "dtype": args.dtype,
                      "backend": args.backend, "torch": torch.__version__, "mask": args.mask,
                      "mask_ndim": mask_ndims[0], "pad_step": args.pad_step,
                      "eager": {"logprobs_finite": lp_ok_e, "nonfinite_grads": bad_e},
                      "compiled": {"logprobs_finite": lp_ok_c, "nonfinite_grads": bad_c},
                      "max_logprob_diff": lp_diff, "max_rel_grad_diff": g_diff}))


if __name__ == "__main__":
    main()
