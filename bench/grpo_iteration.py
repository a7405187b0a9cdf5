"""One GRPO iteration of the `grpo` stage, phase by phase, with FLOP/s against the machine's matmul peak.

In a temp working dir: the prepare stage on the local GSM8K copy, then ONE randomly initialised
policy saved as checkpoints/sft and checkpoints/warmup (random weights: fine for timing, and they
almost never emit a stop token, so rollouts run to the full ``rollout_len``). Then
``pipeline.stages.grpo.setup(cfg, "grpo")``, one warm-up ``grpo_iteration``, and ``--iters`` timed ones.
Dynamic sampling is turned off for the timed stage (``--stage warmup`` has it on by default): with
random weights every group would be dropped and rolled out again.

FLOPs (N = weights that enter a matmul per token, the tied LM head included, embeddings not;
L layers, C width; T the padded width of the rows actually computed, padding included; the LM
head only where it is computed: the last prompt position in the prefill, response columns in the
log-prob passes):
  rollout   prefill 2N per prompt token (B distinct prompts) + decode 2N per row-step
  ref       2N per scored token (N_rows x T)            (skipped when kl_coef = 0)
  old       2N per token, only when grpo_epochs > 1 or minibatches (else old = new.detach())
  update    6N per trained token (forward + backward)
  attention 4*L*C*ctx per token forward (QK^T and AV; ctx = attended keys, causal: T/2 on average),
            x3 in the update
The peak on CPU is the best of the matmul shapes the iteration itself runs (every weight at the
prefill's, the decode steps' and the log-prob/update passes' row counts, ``bench.common.ShapePeak``),
by the fastest GEMM this torch build has for the shape (MKL's ``mm`` or oneDNN's pre-packed linear:
the best the hardware shows, whichever library the iteration itself calls), at the same thread count,
measured after every iteration, interleaved with them, the best over all
(a square 2048^3 ``torch.mm`` measured once is printed beside it: it is not this model's shape and
collapses under load). Where the CPU has bf16 matmul kernels (AVX512-BF16 / AMX) the bf16 peak of
the same shapes is reported too. On CUDA (``model.device`` auto or
cuda, e.g. ``--params configs/gpu.yaml``) it is the best bf16 ``torch.mm`` of 8192x8192 on the GPU
instead, the weight-matmul ceiling is taken in bf16 there too, and the figures add MFU against the
GPU's datasheet dense bf16 peak where known (H100/H200 SXM: 989.4 TFLOP/s) and
``torch.cuda.max_memory_allocated``. ``bench/device_check.sh`` runs it eager and compiled on a GPU.

    .venv/bin/python bench/grpo_iteration.py [--params params.yaml] [--set grpo.group_size=16 ...]
        [--gsm8k PATH] [--threads 1] [--iters 1] [--stage grpo|warmup] [--ab-full-logits] [--ab-shared-prompt]
        [--ab-recompute-old] [--ab-full-width] [--ab-onednn]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (GRPOIterations, ShapePeak, alternate, cpu_has_bf16_kernels, default_gsm8k, emit, fmt_ratios,
                    machine_line, matmul_ceiling, matmul_params, matmul_peak, matmul_weights, pair_ratios,
                    prepare_with_random_policy, timed, workdir)

import torch

PHASES = ("rollout", "scoring", "logprobs", "update")
# dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, FLOP/s, by device-name substring
DATASHEET_BF16 = {"H200": 989.4e12, "H100 SXM": 989.4e12, "H100 80GB HBM3": 989.4e12, "A100": 312e12}


def model_dims(policy) -> tuple[int, int, int, int]:
    """(N matmul params, LM-head params, layers, width) of either backend."""
    cfg = policy.module.config
    layers = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
    width = getattr(cfg, "n_embd", None) or cfg.hidden_size
    return matmul_params(policy.module), cfg.vocab_size * width, layers, width


def iteration_flops(N: int, H: int, L: int, C: int, B: int, rows: int, Tp: int, steps: int, ref: bool,
                    old: bool, shared: bool = False) -> dict:
    """FLOPs of each phase for B prompts of padded width Tp, `rows` = B*G rows, `steps` decode steps.
    N includes the LM head (H params), which the prefill applies to the last prompt position only and
    the log-prob passes to the response columns only (Policy.token_logprobs `start`). `shared`: the
    log-prob passes run each prompt once per group (Policy.token_logprobs `group_size`), the responses
    on top of it."""
    attn = 4 * L * C
    T = Tp + steps
    prefill = 2 * (N - H) * B * Tp + 2 * H * B + attn * B * Tp * Tp / 2
    decode = 2 * N * rows * steps + attn * rows * sum(Tp + t + 1 for t in range(steps))
    if shared:  # one forward pass: B prompts, then the rows' response columns attending to prompt + own keys
        fwd_full = (2 * (N - H) * (B * Tp + rows * steps) + 2 * H * rows * (steps + 1)
                    + attn * (B * Tp * Tp / 2 + rows * steps * (Tp + steps / 2)))
    else:
        fwd_full = 2 * (N - H) * rows * T + 2 * H * rows * (steps + 1) + attn * rows * T * T / 2
    return {"rollout": prefill + decode, "logprobs": fwd_full * (int(ref) + int(old)), "update": 3 * fwd_full,
            "scoring": 0.0}


def _twin_with(cfg, stage: str, name: str, value):
    """One iteration of a second set-up (same seeds) with `pipeline.rl.update`'s `name` replaced by
    `value` for its iterations only (the lever that name switches, turned off)."""
    import pipeline.rl.update as grpo_mod

    twin = GRPOIterations(cfg, stage)

    def iteration():
        real = getattr(grpo_mod, name)
        setattr(grpo_mod, name, value)
        try:
            return twin.iteration()
        finally:
            setattr(grpo_mod, name, real)
    return iteration


def _twin_on_onednn(cfg, stage: str):
    """One iteration of a second set-up (same seeds) whose fp32 linear layers (the rollout's packed
    weights, the log-prob passes, the update's forward and input gradients) run on oneDNN's GEMM
    instead of MKL's (``bench.onednn``): another order of float sums, so a lever, not the pipeline."""
    from onednn import onednn_linears

    twin = GRPOIterations(cfg, stage)

    def iteration():
        with onednn_linears() as on:
            if not on:
                raise SystemExit("--ab-onednn: this torch build has no oneDNN linear")
            return twin.iteration()
    return iteration


def _twin(cfg, stage: str, patch):
    """One iteration of a second set-up (same seeds, so the same prompts and widths) whose
    policies' `token_logprobs` is replaced by `patch(original)`."""
    twin = GRPOIterations(cfg, stage)
    for policy in (twin.run.policy, twin.run.ref):
        if policy is not None:
            policy.token_logprobs = patch(policy.token_logprobs)  # the instance attribute shadows the method
    return twin.iteration


def paired_ab(all_times: dict[str, list[float]], wall: float, twin: str, lever: str, twin_label: str,
              label: str) -> dict:
    """The A/B figures of a twin trainer timed alternately with the iteration (`wall` its median):
    `<twin>_s` (the same statistic), `<lever>_speedup`, `<twin>_times` and `<lever>_pairs` (the
    paired ratios twin / iteration); printed as one line."""
    twin_s = statistics.median_low(all_times[twin])  # the statistic of `wall`
    out = {f"{twin}_s": round(twin_s, 4), f"{lever}_speedup": round(twin_s / wall, 3),
           f"{twin}_times": [round(t, 4) for t in all_times[twin]],
           f"{lever}_pairs": pair_ratios(all_times, twin, "iteration")}
    print(f"A/B: {twin_label} {twin_s:.3f}s vs {label} {wall:.3f}s = {twin_s / wall:.2f}x; paired "
          f"{fmt_ratios(out[f'{lever}_pairs'])} (" + ", ".join(f"{t:.3f}" for t in all_times[twin]) + ")")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(Path(__file__).resolve().parents[1] / "params.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--gsm8k", default=None, help="local GSM8K copy (default: $GSM8K)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a small CPU shared with other jobs more threads thrash)")
    ap.add_argument("--iters", type=int, default=1, help="timed iterations after one warm-up iteration")
    ap.add_argument("--stage", default="grpo", choices=["grpo", "warmup"])
    ap.add_argument("--ab-full-logits", action="store_true",
                    help="also time a twin trainer (same seeds, so the same prompts and widths) whose log-prob "
                         "passes project every column onto the vocabulary (token_logprobs start=1, the old "
                         "behaviour; it also turns the shared-prompt path off, which needs start > 1), "
                         "alternating iteration by iteration")
    ap.add_argument("--ab-shared-prompt", action="store_true",
                    help="also time a twin trainer whose log-prob passes run every row's prompt "
                         "(token_logprobs group_size=1: no shared prompt), alternating")
    ap.add_argument("--ab-recompute-old", action="store_true",
                    help="also time a twin trainer that recomputes the old log-probs with a forward pass instead "
                         "of taking the rollout's recorded ones (matters with several optimizer steps per "
                         "iteration: --stage warmup, or minibatch_groups / grpo_epochs), alternating")
    ap.add_argument("--ab-full-width", action="store_true",
                    help="also time a twin trainer whose micro-batches (micro_batch_size > 0) run their log-prob "
                         "and update passes at the batch's full width instead of their own, alternating")
    ap.add_argument("--ab-onednn", action="store_true",
                    help="also time a twin trainer whose fp32 linear layers run on oneDNN's GEMM instead of MKL's "
                         "(bench/onednn.py: another order of float sums, not the pipeline's kernel), alternating")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import pipeline.stages.grpo as grpo_mod
    from pipeline.core.config_loading import load_config
    from pipeline.rl.update import reuses_sampled_logprobs

    from pipeline.model.policy import resolve_device

    gsm8k = str(Path(args.gsm8k).resolve()) if args.gsm8k else default_gsm8k()  # the bench runs in a temp dir
    # A random-init policy earns reward 0 on every row, so with dynamic sampling every group would be
    # dropped and re-rolled until the last round: the bench would time top-up rounds that a trained
    # policy mostly skips, and count the FLOPs of the kept rollout only. It times the plain iteration.
    cfg = load_config(args.params, [f"data.gsm8k_source={gsm8k}", "tracking.enabled=false", *args.overrides,
                                    f"{args.stage}.dynamic_sampling=false"])
    device = resolve_device(cfg.model.device)
    cuda = device.type == "cuda"
    # the practical matmul peak of the device the iteration runs on: fp32 2048^3 on CPU, bf16 8192^3 on CUDA
    peak_args = dict(n=8192, repeats=10, dtype="bfloat16", device=str(device)) if cuda else dict(n=2048, repeats=3)
    # (on CPU the peak reported is ShapePeak's, over the iteration's own shapes; the square one is printed beside it)
    ceil_args = dict(dtype="bfloat16", device=str(device)) if cuda else {}
    peak0 = matmul_peak(**peak_args)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with workdir():
        t_prep, _ = timed(lambda: prepare_with_random_policy(cfg))
        trainer = GRPOIterations(cfg, args.stage)
        seen = {}
        sample = grpo_mod.sample_groups

        def capture(*a, **k):  # keep the last rollout's shapes for the FLOP count
            out = sample(*a, **k)
            seen["ro"] = out.rollout
            return out

        grpo_mod.sample_groups = capture
        metrics: list[dict] = []

        def one():
            m, _ = trainer.iteration()
            metrics.append(m)

        shape_peak = ShapePeak("float32")
        bf16_peak = ShapePeak("bfloat16") if not cuda and cpu_has_bf16_kernels() else None

        def peaks():  # between iterations: the shapes of the rollout just run, under the same load
            ro = seen["ro"]
            rows = [ro.input_ids.shape[0], g_cfg.prompts_per_iter * ro.prompt_len,
                    ro.input_ids.shape[0] * (ro.input_ids.shape[1] - ro.prompt_len)]
            for sp in (shape_peak, bf16_peak):
                if sp is not None:
                    sp.measure(matmul_weights(trainer.policy.module), rows)

        g_cfg = trainer.g
        runs = {"iteration": one} if cuda else {"iteration": one, "peak": peaks}
        if args.ab_full_logits:  # log-probs over every column (no `start`, no shared prompt)
            runs["full_logits"] = _twin(cfg, args.stage, lambda lp: lambda *a, start=1, group_size=1, **k: lp(*a, **k))
        if args.ab_shared_prompt:  # each row runs its own prompt (no `group_size`)
            runs["per_row_prompts"] = _twin(cfg, args.stage, lambda lp: lambda *a, group_size=1, **k: lp(*a, **k))
        if args.ab_recompute_old:  # the old pass recomputed (the plain path of that lever only)
            # the old log-probs recomputed with a forward pass instead of the rollout's recorded ones
            runs["recomputed_old"] = _twin_with(cfg, args.stage, "reuses_sampled_logprobs", lambda policy: False)
        if args.ab_full_width:
            # every micro-batch at the batch's full width (the longest response), not its own
            runs["full_width"] = _twin_with(cfg, args.stage, "own_width", lambda mask: mask.shape[1])
        if args.ab_onednn:
            runs["onednn"] = _twin_on_onednn(cfg, args.stage)
        all_times = alternate(runs, args.iters)
        times = all_times["iteration"]
        metrics = metrics[1:]  # drop the warm-up
        ro, policy, g = seen["ro"], trainer.policy, trainer.g
    max_mem = torch.cuda.max_memory_allocated(device) if cuda else None
    square = max(peak0, matmul_peak(**peak_args))
    peak = square if cuda else shape_peak.best
    shapes = matmul_weights(policy.module)
    # the same weight matmuls alone: at the decode steps' rows, and at the log-prob/update passes' rows
    ceil_decode = matmul_ceiling(shapes, ro.input_ids.shape[0], **ceil_args)
    ceil_train = matmul_ceiling(shapes, int(ro.input_ids.shape[0] * (ro.input_ids.shape[1] - ro.prompt_len)),
                                **ceil_args)
    gpu_name = torch.cuda.get_device_name(device) if cuda else None
    spec = DATASHEET_BF16.get(next((k for k in DATASHEET_BF16 if gpu_name and k in gpu_name), None))

    N, H, L, C = model_dims(policy)
    B, rows, Tp = g.prompts_per_iter, ro.input_ids.shape[0], ro.prompt_len
    steps = ro.input_ids.shape[1] - Tp
    single = g.grpo_epochs == 1 and g.minibatch_groups in (0, g.prompts_per_iter)
    old_pass = not single and not reuses_sampled_logprobs(policy)  # else the rollout's own log-probs
    shared = policy._shares_prompt(ro.input_ids, ro.attention_mask, Tp, g.group_size)
    flops = iteration_flops(N, H, L, C, B, rows, Tp, steps, ref=g.kl_coef > 0, old=old_pass, shared=shared)
    # the median iteration (the lower of the middle two for an even count: a real iteration, whose
    # phases add up to its wall time; the first of two would otherwise stand in for their median)
    wall = statistics.median_low(times)
    phase_s = {p: metrics[times.index(wall)][f"time_{p}"] for p in PHASES}  # its phases: they add up to it
    phase_s["other"] = max(wall - sum(phase_s.values()), 0.0)  # reward scoring, metrics, Python
    gen_tokens = float(ro.response_mask.sum())
    total_flops = sum(flops.values())

    print(machine_line(args.threads))
    print(f"model: {policy.backend}, {N / 1e6:.2f}M matmul params, {L}x{C}; {B} prompts x G={g.group_size}, "
          f"prompt width {Tp}, {steps} decode steps, {gen_tokens:.0f} generated tokens; kl_coef {g.kl_coef}; "
          f"prepare took {t_prep:.1f}s (not timed); random init; log-prob passes "
          + ("run each prompt once per group" if shared else "run every row's prompt"))
    if cuda:
        print(f"device: {gpu_name}; matmul peak (bf16 8192^3 mm, measured): {peak / 1e12:.1f} TFLOP/s"
              + (f"; datasheet dense bf16 {spec / 1e12:.1f} TFLOP/s" if spec else ""))
    else:
        m, k, n = shape_peak.best_shape
        print(f"matmul peak (fp32, best of the iteration's own shapes, measured after each iteration, "
              f"{args.threads} thread(s)): {peak / 1e9:.1f} GFLOP/s at ({m} x {k}) @ ({k} x {n}) "
              f"({shape_peak.best_library}); "
              f"a square 2048^3 mm: {square / 1e9:.1f} GFLOP/s")
        print(f"bf16 peak of the same shapes: {bf16_peak.best / 1e9:.1f} GFLOP/s ({bf16_peak.best_library})" if bf16_peak is not None
              else "bf16: this CPU has no bf16 matmul kernels (emulated bf16 is slower than fp32): no bf16 peak")
    which = "lower median" if len(times) % 2 == 0 else "median"
    print(f"iteration: {wall:.3f}s ({which} of {len(times)}: " + ", ".join(f"{t:.3f}" for t in times) + ")")
    print(f"{'phase':10s} {'s':>8s} {'share':>6s} {'GFLOP':>8s} {'GFLOP/s':>8s} {'of peak':>8s}")
    for p, s in phase_s.items():
        f = flops.get(p, 0.0)
        rate = f / s if s > 0 else 0.0
        print(f"{p:10s} {s:8.3f} {s / wall:6.1%} {f / 1e9:8.2f} {rate / 1e9:8.2f} {rate / peak:8.1%}")
    rate = total_flops / wall
    print(f"{'total':10s} {wall:8.3f} {1:6.0%} {total_flops / 1e9:8.2f} {rate / 1e9:8.2f} {rate / peak:8.1%}")
    print(f"tokens/s (generated tokens / iteration wall): {gen_tokens / wall:.0f}")
    skipped = int(metrics[-1].get("skipped_steps", 0)) if metrics else 0  # the trainer's count, warm-up included
    print(f"optimizer steps skipped as non-finite (warm-up included): {skipped}")
    if cuda:
        print(f"MFU: {rate / peak:.1%} of the measured bf16 peak"
              + (f", {rate / spec:.1%} of the datasheet's" if spec else "")
              + f"; max CUDA memory allocated {max_mem / 2**30:.2f} GiB")
    print(f"the model's weight matmuls alone (no attention, no other ops): {ceil_decode / 1e9:.2f} GFLOP/s "
          f"({ceil_decode / peak:.1%} of peak) at the decode steps' {rows} rows, {ceil_train / 1e9:.2f} GFLOP/s "
          f"({ceil_train / peak:.1%}) at the log-prob/update passes' {rows * steps} response rows; the iteration "
          f"runs at {rate / ceil_decode:.0%} / {rate / ceil_train:.0%} of those")
    ab = {}
    if args.ab_full_logits:
        full_s = statistics.median_low(all_times["full_logits"])  # the statistic of `wall`
        ab = {"full_logits_s": round(full_s, 4), "start_speedup": round(full_s / wall, 3),
              "full_logits_times": [round(t, 4) for t in all_times["full_logits"]]}
        print(f"A/B: vocabulary projection on every column {full_s:.3f}s vs response columns only {wall:.3f}s "
              f"= {full_s / wall:.2f}x (" + ", ".join(f"{t:.3f}" for t in all_times["full_logits"]) + ")")
    if args.ab_shared_prompt:
        row_s = statistics.median_low(all_times["per_row_prompts"])  # the statistic of `wall`
        ab.update({"per_row_prompts_s": round(row_s, 4), "shared_prompt_speedup": round(row_s / wall, 3),
                   "per_row_prompts_times": [round(t, 4) for t in all_times["per_row_prompts"]]})
        print(f"A/B: every row's prompt in the log-prob passes {row_s:.3f}s vs once per group {wall:.3f}s "
              f"= {row_s / wall:.2f}x (" + ", ".join(f"{t:.3f}" for t in all_times["per_row_prompts"]) + ")")
    if args.ab_recompute_old:
        ab.update(paired_ab(all_times, wall, "recomputed_old", "recorded_old",
                            "old log-probs recomputed", "the rollout's recorded ones"))
    if args.ab_full_width:
        ab.update(paired_ab(all_times, wall, "full_width", "own_width",
                            "micro-batches at the batch's full width", "their own width"))
    if args.ab_onednn:
        dnn_s = statistics.median_low(all_times["onednn"])  # the statistic of `wall`
        ab.update({"onednn_s": round(dnn_s, 4), "onednn_times": [round(t, 4) for t in all_times["onednn"]],
                   "onednn_pairs": pair_ratios(all_times, "iteration", "onednn")})
        print(f"A/B: every fp32 linear on oneDNN {dnn_s:.3f}s vs MKL {wall:.3f}s; paired MKL / oneDNN "
              f"{fmt_ratios(ab['onednn_pairs'])} (" + ", ".join(f"{t:.3f}" for t in all_times["onednn"]) + ")")
    emit({"bench": "grpo_iteration", "params": args.params, "overrides": args.overrides, "threads": args.threads,
          "seconds_per_iteration": round(wall, 4), "times": [round(t, 4) for t in times],
          "phases_s": {k: round(v, 4) for k, v in phase_s.items()},
          "phase_gflop": {k: round(v / 1e9, 3) for k, v in flops.items()},
          "gflop_per_iteration": round(total_flops / 1e9, 3), "gflop_s": round(rate / 1e9, 3),
          "matmul_peak_gflop_s": round(peak / 1e9, 2), "fraction_of_peak": round(rate / peak, 4),
          "peak_shape": None if cuda else shape_peak.best_shape,
          "peak_library": None if cuda else shape_peak.best_library, "square_2048_gflop_s": round(square / 1e9, 2),
          **({"bf16_peak_gflop_s": round(bf16_peak.best / 1e9, 2),
              "fraction_of_bf16_peak": round(rate / bf16_peak.best, 4)} if bf16_peak is not None else {}),
          "decode_shape_matmul_gflop_s": round(ceil_decode / 1e9, 2),
          "train_shape_matmul_gflop_s": round(ceil_train / 1e9, 2),
          "generated_tokens": gen_tokens, "tokens_per_s": round(gen_tokens / wall, 1),
          "matmul_params": N, "rows": rows, "prompt_width": Tp, "decode_steps": steps, "shared_prompt": shared,
          "device": gpu_name or "cpu", "skipped_steps": skipped,
          **({"mfu_datasheet": round(rate / spec, 4), "datasheet_bf16_tflop_s": spec / 1e12} if spec else {}),
          **({"max_cuda_memory_gib": round(max_mem / 2**30, 3)} if cuda else {}),
          **({"compiled_graphs": compiled_graphs()} if cfg.model.compile else {}), **ab})


def compiled_graphs() -> dict:
    """torch.compile's counts so far: graphs compiled and frames compiled (each recompile of a
    function is another frame; dynamo keeps no recompile counter of its own, and
    `TORCH_LOGS=recompiles` names the guard behind each one) and graph breaks."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_compiled": int(counters["frames"]["ok"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


if __name__ == "__main__":
    main()
