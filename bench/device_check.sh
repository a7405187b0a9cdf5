#!/usr/bin/env bash
# The GPU check in one lease, nothing downloaded: at most 8 minutes on one H100 or H200. A lease is 15
# minutes of device time for everything, start-up included; the step limits below add up to 480 s and
# no step runs past 480 s from the start (bench/tests/test_device_check.py holds both).
#     bash bench/device_check.sh
# The steps, in order of value (a step its limit cuts fails, and the next one still runs):
#   env        the GPU, driver, torch and package versions
#   tests      the tests marked `gpu` (a GRPO iteration, a bf16 LoRA update, a 1e-6 update of bf16
#              weights through the optimizer's fp32 masters, all on CUDA)
#   build      a Qwen2 of Qwen2.5-0.5B's shape (24 layers, width 896, 14 query and 2 key/value heads,
#              MLP 4864, 151,936-row tied vocabulary) with random weights, built from a config
#              (bench/tiny_instruct.py: the machine reaches no hub), and the same cut to 2 layers
#   eager      one GRPO iteration of configs/instruct.yaml on it after a warm-up one (16 prompts x 8,
#              384 new tokens), eager
#   lora       the same at 8 prompts x 8 and 128 new tokens, with LoRA r=16 on q/k/v/o (peft)
#   recompute  the same (8 x 8, 128 tokens) with gradient checkpointing
#   bf16       the same with bf16 weights (model.param_dtype=bfloat16: fp32 masters in the optimizer)
#   compiled   the same under model.compile on a 2-layer cut (Inductor on all 24 layers takes
#              minutes), with all that is left of the 480 s (its 125 s at least when every earlier
#              step kept to its limit); recompiles logged in compiled.txt
# Each step prints one JSON line (bench/device_line.py: step, ok, seconds, limit_s, tokens_per_s, mfu
# against the bf16 matmul peak measured on the GPU, peak_mem_gb from torch.cuda.max_memory_allocated),
# also added to $OUT/results.jsonl; its whole output is $OUT/<step>.txt ($OUT: .device/out). Exit 1 if
# a step failed. ONLY="lora compiled" runs just the steps named (and build, unless $MODELS holds the
# models of an earlier run: they go to a temporary folder otherwise), adding to results.jsonl.
# The measured peak of `eager` compares with the estimate, which needs no GPU:
#     python bench/memory.py --estimate --params configs/instruct.yaml --size 0.5B
# Needs torch, tokenizers, safetensors, PyYAML, transformers; pytest for `tests`, peft for `lora`.
# GSM8K: $GSM8K, else the repository's fixture (tests/fixtures/gsm8k: enough prompts for an iteration).
#
# The dry run, on a CPU, checks the plumbing in about a minute, not the figures:
#     DRY_RUN=1 PYTHON=.venv/bin/python bash bench/device_check.sh
# every step on a tiny shape (a 2 x 64 Qwen2 with a 4,096-row vocabulary, 2 prompts x 4, 16 new
# tokens); `tests` collects the gpu tests (skipped without CUDA); `compiled` runs with dynamo off
# (TORCHDYNAMO_DISABLE=1: Inductor on a CPU takes minutes), so only its config path is exercised.
set -uo pipefail
budget=480
declare -A limit=([env]=10 [tests]=40 [build]=40 [eager]=100 [lora]=55 [recompute]=55 [bf16]=55 [compiled]=125)
grace=3  # seconds a step gets after its limit's SIGTERM before SIGKILL

out=${OUT:-$PWD/.device/out}
mkdir -p "$out"
if [ -n "${MODELS:-}" ]; then  # the built models, kept out of $OUT (2.6 GB of random weights)
    models=$MODELS
else
    models=$(mktemp -d)
    trap 'rm -rf "$models"' EXIT
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true TOKENIZERS_PARALLELISM=false
export GSM8K=${GSM8K:-$PWD/tests/fixtures/gsm8k}
export py=${PYTHON:-python3}
dry=${DRY_RUN:-${DEVICE_CHECK_DRY:-0}}
[ -e "$GSM8K" ] || { echo "no GSM8K copy at $GSM8K: set GSM8K to a folder with train.jsonl and test.jsonl" >&2; exit 2; }
only=${ONLY:-}
for s in $only; do
    [[ -n ${limit[$s]+x} ]] || { echo "ONLY: no step named '$s'; allowed: ${!limit[*]}" >&2; exit 2; }
done
wanted() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
[ -n "$only" ] || : > "$out/results.jsonl"  # a rerun of some steps adds to the results of the full run
failed=0

# `report STEP EXIT SECONDS LIMIT [FILE] [--skipped WHY]`: the step's JSON line, printed and saved
report() {
    local line
    line=$("$py" bench/device_line.py "$@") || line="{\"step\": \"$1\", \"ok\": false, \"exit\": $2}"
    echo "$line" | tee -a "$out/results.jsonl"
    [[ $line == *'"ok": true'* ]] || failed=1
}

# `step STEP CMD...`: CMD under the step's limit, cut to what is left of the budget (the last step,
# compiled, gets all of that)
step() {
    local name=$1 lim=${limit[$1]} t0=$SECONDS rc
    shift
    if [ "$name" = compiled ] || (( lim > budget - grace - SECONDS )); then
        lim=$((budget - grace - SECONDS))
    fi
    if (( lim < 5 )); then
        report "$name" 0 0 "$lim" --skipped "no time left of the $budget s"
        return
    fi
    timeout -k "$grace" "$lim" "$@" > "$out/$name.txt" 2>&1
    rc=$?
    report "$name" "$rc" "$((SECONDS - t0))" "$lim" "$out/$name.txt"
}

skip() { report "$1" 0 0 "${limit[$1]}" --skipped "$2"; }  # `skip STEP WHY`
has() { "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)" 2>/dev/null; }  # no import

env_probe() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    "$py" -c 'import importlib.metadata as m, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for p in ("transformers", "peft", "tokenizers", "safetensors", "pytest"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "not installed")'
}

# `build ARGS...`: the model and its cut (ARGS: bench/tiny_instruct.py's shape flags)
build() {
    "$py" bench/tiny_instruct.py "$models/qwen2" "$@" &&
        "$py" bench/tiny_instruct.py "$models/qwen2-cut" "$@" --layers "$cut_layers"
}
export -f env_probe build
export models

if [ "$dry" = 1 ]; then
    shape=(--layers 2 --width 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 4096)
    export cut_layers=1
    tiny=(--set grpo.prompts_per_iter=2 --set grpo.minibatch_groups=1 --set grpo.group_size=4
          --set grpo.rollout_len=16 --set grpo.micro_batch_size=4)
    full=("${tiny[@]}") small=("${tiny[@]}") compiler=(env TORCHDYNAMO_DISABLE=1)
else
    shape=(--layers 24 --width 896 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936)
    export cut_layers=2
    full=() small=(--set grpo.prompts_per_iter=8 --set grpo.rollout_len=128)
    compiler=(env TORCH_LOGS=recompiles)
fi
# one warm-up and one timed iteration; dynamic sampling off (bench/grpo_iteration.py)
grpo=("$py" bench/grpo_iteration.py --params configs/instruct.yaml --iters 1 --set model.device=auto
      --set data.val_size=20)

wanted env && step env bash -c env_probe
if wanted tests; then
    if has pytest; then
        step tests "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_device.py tests/test_lora.py \
            tests/test_bf16.py
    else
        skip tests "pytest not installed"
    fi
fi
# the model steps, each a GRPO iteration set-up of its own (bench/grpo_iteration.py)
model_steps() {
    local s need=0
    for s in eager lora recompute bf16 compiled; do wanted "$s" && need=1; done
    if wanted build || { [ "$need" = 1 ] && [ ! -e "$models/qwen2-cut/config.json" ]; }; then
        step build bash -c 'build "$@"' build "${shape[@]}"
    fi
    wanted eager && step eager "${grpo[@]}" --set "model.init=$models/qwen2" ${full[@]+"${full[@]}"}
    if wanted lora && has peft; then
        step lora "${grpo[@]}" --set "model.init=$models/qwen2" "${small[@]}" --set model.lora_rank=16
    elif wanted lora; then
        skip lora "peft not installed"
    fi
    wanted recompute && step recompute "${grpo[@]}" --set "model.init=$models/qwen2" "${small[@]}" \
        --set model.gradient_checkpointing=true
    wanted bf16 && step bf16 "${grpo[@]}" --set "model.init=$models/qwen2" "${small[@]}" \
        --set model.param_dtype=bfloat16
    wanted compiled && step compiled "${compiler[@]}" "${grpo[@]}" --set "model.init=$models/qwen2-cut" "${small[@]}" \
        --set model.compile=true
}

if has transformers; then
    model_steps
else
    for s in build eager lora recompute bf16 compiled; do wanted "$s" && skip "$s" "transformers not installed"; done
fi
echo "results: $out/results.jsonl"
exit $failed
