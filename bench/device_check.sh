#!/usr/bin/env bash
# The GPU figures of one GRPO iteration of configs/gpu.yaml, eager and compiled, in one run on a
# CUDA machine (it needs only torch, tokenizers, safetensors and PyYAML; nothing is downloaded):
#     bash bench/device_check.sh      # at most about 9 minutes: the two runs' time limits
# GSM8K: $GSM8K, else the repository's test fixture (tests/fixtures/gsm8k: enough prompts to time an
# iteration). Prints the figures and writes each run's full output under $OUT (default .device/out).
# `bench/grpo_iteration.py` on CUDA measures the bf16 matmul peak on the GPU and reports MFU against
# it and against the datasheet, tokens/s and max CUDA memory; its last line is a JSON object.
# A dry run of this script on a CPU box: DEVICE_CHECK_PARAMS=configs/smoke.yaml PYTHON=.venv/bin/python
set -uo pipefail
out=${OUT:-$PWD/.device/out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DO_NOT_TRACK=true \
       MLFLOW_DISABLE_TELEMETRY=true TOKENIZERS_PARALLELISM=false
export GSM8K=${GSM8K:-$PWD/tests/fixtures/gsm8k}
py=${PYTHON:-python3}
params=${DEVICE_CHECK_PARAMS:-configs/gpu.yaml}
[ -e "$GSM8K" ] || { echo "no GSM8K copy at $GSM8K: set GSM8K to a folder with train.jsonl and test.jsonl" >&2; exit 2; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  $py -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
          "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
} | tee "$out/env.txt"

# one timed GRPO iteration setup per mode: `name limit_s args...`. The curriculum is cut to 20k rows
# (the prepare stage's BPE training is CPU time, and the grpo stage samples GSM8K prompts only);
# 20 validation rows, so that the 80-row fixture suffices.
run() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$py" bench/grpo_iteration.py --params "$params" --set data.arith_train_size=20000 \
        --set data.val_size=20 \
        --iters 3 "$@" > "$out/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    grep -E "^(device|model|iteration|rollout|logprobs|update|total|tokens/s|MFU|the model)" "$out/$name.txt"
    tail -n 1 "$out/$name.txt"
}
run eager 200 --set model.compile=false
run compiled 300
