#!/usr/bin/env bash
# The GPU check in one run on a CUDA machine, nothing downloaded, at most ~14 minutes (the time
# limits below add up to 840 s, plus ~20 s to build the model; on an H200 machine the steps took
# 9-10 minutes together, from the times of their parts):
#     bash bench/device_check.sh
# 1. the tests marked `gpu` (a GRPO iteration and a bf16 LoRA update on CUDA) with the rest of
#    tests/test_device.py and tests/test_lora.py (the simulated-accelerator check among them);
# 2. one GRPO iteration of configs/gpu.yaml (the 406M GPT), eager and compiled;
# 3. configs/instruct.yaml on a random Qwen2 built on the spot (bench/tiny_instruct.py: 4 x 256,
#    GQA 8/2, Qwen2.5's 151,936-row vocabulary, ChatML template), eager and compiled, with the
#    memory estimate of bench/memory.py for the same model beside the measured peak.
# The compiled runs time 3 iterations, not 2: a recompile for dynamic shapes can land in the first
# timed one, and the median of 3 is then the steady state. They log each recompile and its cause
# (TORCH_LOGS=recompiles) into their output file. Inductor takes over two minutes on the 406M GPT's
# graphs on an H200 machine's 16 cores, hence that run's 270 s; the Qwen2's compiled run took 125 s.
# 4. bench/compiled_grads.py on the same Qwen2: eager against compiled gradients on left-padded
#    rows (bf16 autocast and fp32), printed and added to results.jsonl.
# ONLY="gpu_compiled instruct_compiled" runs just the steps named (tests, gpu_eager, gpu_compiled,
# instruct_eager, instruct_compiled, memory, compiled_grads), adding to results.jsonl: a rerun of
# the ones that failed.
# Each `bench/grpo_iteration.py` run measures the bf16 matmul peak on the GPU and reports MFU
# against it, tokens/s and max CUDA memory; its last line is a JSON object, gathered with the run's
# name into $OUT/results.jsonl (full outputs: $OUT/<name>.txt). $OUT defaults to .device/out.
# Needs torch, tokenizers, safetensors, PyYAML; transformers for step 3 and pytest for step 1 (a step
# whose imports are missing is skipped with a line saying so). GSM8K: $GSM8K, else the repository's
# test fixture (tests/fixtures/gsm8k: enough prompts to time an iteration).
# A dry run on a CPU box (small shapes): DEVICE_CHECK_DRY=1 PYTHON=.venv/bin/python bash bench/device_check.sh
set -uo pipefail
out=${OUT:-$PWD/.device/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true TOKENIZERS_PARALLELISM=false
export GSM8K=${GSM8K:-$PWD/tests/fixtures/gsm8k}
py=${PYTHON:-python3}
dry=${DEVICE_CHECK_DRY:-0}
[ -e "$GSM8K" ] || { echo "no GSM8K copy at $GSM8K: set GSM8K to a folder with train.jsonl and test.jsonl" >&2; exit 2; }
only=${ONLY:-}
steps=" tests gpu_eager gpu_compiled instruct_eager instruct_compiled memory compiled_grads "
for s in $only; do
    [[ $steps == *" $s "* ]] || { echo "ONLY: no step named '$s'; allowed:$steps" >&2; exit 2; }
done
wanted() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
[ -n "$only" ] || : > "$out/results.jsonl"  # a rerun of some steps adds to the results of the full run

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  $py -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
          "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
  $py -c 'import importlib.metadata as m
for p in ("transformers", "peft", "tokenizers", "safetensors"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, "not installed")'
} | tee "$out/env.txt"

has() { $py -c "import $1" 2>/dev/null; }

# `run name limit_s params args...`: one timed GRPO iteration set-up (1 warm-up + --iters timed)
run() {
    local name=$1 limit=$2 params=$3
    shift 3
    wanted "$name" || return 0
    local logs=()  # (an empty TORCH_LOGS breaks `import torch`: set it only where wanted)
    case $name in *compiled) logs=(TORCH_LOGS=recompiles) ;; esac
    local t0=$SECONDS
    env ${logs[@]+"${logs[@]}"} timeout "$limit" "$py" bench/grpo_iteration.py --params "$params" --set data.val_size=20 "$@" \
        > "$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    grep -E "^(device|model|iteration|rollout|logprobs|update|total|tokens/s|MFU|optimizer steps skipped)" "$out/$name.txt"
    record "$name" "$rc" "$out/$name.txt"
}

# `record name rc file`: the run's last line (its JSON object) into results.jsonl, or its tail if none
record() {
    local last
    last=$(tail -n 1 "$3")
    case $last in
        "{"*) echo "{\"run\": \"$1\", \"exit\": $2, \"result\": $last}" >> "$out/results.jsonl" ;;
        *) echo "{\"run\": \"$1\", \"exit\": $2}" >> "$out/results.jsonl"; tail -n 5 "$3" ;;
    esac
}

# --- 1. tests on the device ----------------------------------------------------------------------
if ! wanted tests; then
    :
elif has pytest; then
    timeout 40 "$py" -m pytest -q -p no:cacheprovider -m "gpu or not slow" tests/test_device.py tests/test_lora.py \
        > "$out/tests.txt" 2>&1
    echo "== tests: exit $?"; tail -n 3 "$out/tests.txt"
else
    echo "== tests: skipped (no pytest)"
fi

# --- 2. configs/gpu.yaml ------------------------------------------------------------------------
if [ "$dry" = 1 ]; then
    gpu=(configs/smoke.yaml --set model.device=auto)
else  # the curriculum cut to 20k rows (the prepare stage's BPE is CPU time; grpo samples GSM8K only)
    gpu=(configs/gpu.yaml --set data.arith_train_size=20000)
fi
run gpu_eager 120 "${gpu[@]}" --iters 2 --set model.compile=false
run gpu_compiled 270 "${gpu[@]}" --iters 3 --set model.compile=true

# --- 3. configs/instruct.yaml on a random Qwen2 -------------------------------------------------
if ! { wanted instruct_eager || wanted instruct_compiled || wanted memory || wanted compiled_grads; }; then
    :
elif has transformers; then
    tiny=$out/tiny-qwen2
    if [ "$dry" = 1 ]; then
        "$py" bench/tiny_instruct.py "$tiny" --vocab 4096 > /dev/null
        small=(--set grpo.prompts_per_iter=2 --set grpo.minibatch_groups=1 --set grpo.group_size=4
               --set grpo.rollout_len=16 --set grpo.micro_batch_size=4)
    else
        "$py" bench/tiny_instruct.py "$tiny" > /dev/null
        small=()
    fi
    inst=(configs/instruct.yaml --set "model.init=$tiny" --set model.device=auto ${small[@]+"${small[@]}"})
    run instruct_eager 60 "${inst[@]}" --iters 2 --set model.compile=false
    run instruct_compiled 170 "${inst[@]}" --iters 3 --set model.compile=true
    wanted memory && "$py" bench/memory.py --estimate --params configs/instruct.yaml --hf-config "$tiny" ${small[@]+"${small[@]}"} \
        > "$out/instruct_memory_estimate.txt" 2>&1
    if wanted memory; then
        echo "== instruct memory estimate (measured peak: max_cuda_memory_gib of instruct_eager)"
        head -n 8 "$out/instruct_memory_estimate.txt"
    fi
    # 4. eager against compiled gradients of that Qwen2 on left-padded rows, bf16 autocast and fp32;
    # JSON into results
    if wanted compiled_grads; then
        for dt in auto float32; do
            timeout 90 "$py" bench/compiled_grads.py "$tiny" --dtype "$dt" > "$out/grads.tmp" 2>&1
            rc=$?
            echo "== compiled_grads --dtype $dt: exit $rc"
            grep -E "^(device|eager|compiled|largest)" "$out/grads.tmp"
            record "compiled_grads_$dt" "$rc" "$out/grads.tmp"
            rm -f "$out/grads.tmp"
        done
    fi
else
    echo "== instruct: skipped (no transformers)"
fi
echo "results: $out/results.jsonl"
