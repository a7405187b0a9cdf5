# Two commands do all the set-up on a fresh machine (Python >= 3.11), in either order:
#   make run [GSM8K=/path/to/gsm8k]   venv + install + the whole pipeline (DVC's stages) on params.yaml
#   make test                         venv + install + the fast test suite (everything not marked slow)
#   make test-all                     the full suite: slow and integration tests too (what CI runs)
PYTHON     ?= python3
VENV       ?= .venv
# CPU wheel by default; on a CUDA box e.g. TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# Another GSM8K copy (file or folder with train/test JSONL or Parquet); empty = data.gsm8k_source in params.yaml
# (the copy committed under datasets/gsm8k)
GSM8K      ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
# No telemetry from Prefect, MLflow, DVC (repo config) or HF libraries.
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup run demo run-instruct test test-all bench clean-outputs
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev,lora]" -c requirements.lock
	touch $@

# The main job: every stage through DVC, as the Prefect flow runs it (flows/grpo_pipeline.py): DVC
# decides what is up to date, one MLflow parent run holds the stages, the end is a table of the
# headline numbers. GSM8K is read from the clone (datasets/gsm8k), so the run needs no hub and, on the
# committed params, compares with the dvc.lock and metrics/ committed. With GSM8K=PATH another copy is a DVC-tracked
# override (data.gsm8k_source), so the run is a DVC experiment: tracked files stay as they are (`dvc
# exp show` lists it; `dvc exp branch NAME B && git checkout B && dvc checkout dvc.yaml` takes it into the
# workspace), and the hub is never contacted.
run: setup
	$(if $(strip $(GSM8K)),HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1) \
	  PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m flows.grpo_pipeline \
	  $(if $(strip $(GSM8K)),--set data.gsm8k_source=$(abspath $(GSM8K)))

# The first look (configs/demo.yaml, about 6 minutes on 2 cores): the same flow on a 2-layer GPT and
# one- and two-digit arithmetic, tracking on. The warmup's reward and held-out accuracy rise; the end
# says where to look (MLflow and Prefect UIs). A params file other than params.yaml makes the run a DVC
# experiment, so the committed default run's outputs in the workspace stay as they are.
demo: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m flows.grpo_pipeline \
	  --params configs/demo.yaml

# The pretrained-model recipe (recipes/smollm2: its own dvc.yaml, params.yaml, dvc.lock and results):
# SmolLM2-135M-Instruct from its package on the index, GRPO on arithmetic then GSM8K, scored against its
# zero-shot and few-shot self. The same flow as `run`, in that folder (about 1 h on 2 cores, 12 GB).
RECIPE ?= recipes/smollm2
run-instruct: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m flows.grpo_pipeline \
	  --recipe $(RECIPE)

# Tests read GSM8K from the committed fixture (tests/fixtures/gsm8k) and never contact a hub.
TEST_ENV := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PATH="$(abspath $(BIN)):$$PATH"

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest -m 'not slow' $(PYTEST_ARGS)

# -m '' clears the default 'not slow' selection: every test runs, so the run can never collect nothing.
test-all: setup
	$(TEST_ENV) $(BIN)/python -m pytest -m '' $(PYTEST_ARGS)

clean-outputs:
	rm -rf data checkpoints metrics plots/*.png reports mlflow.db

# Benchmarks (bench/*.py; figures in docs/results/). A separate venv so TRL (the `bench` extra)
# never enters the product's lock: torch first (the local CPU wheel; a bare `torch` would pull CUDA).
BENCH_VENV ?= .venv-bench
BENCH_BIN  := $(BENCH_VENV)/bin

.PHONY: bench-venv
bench-venv: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_BIN)/python -m pip install --quiet --upgrade pip
	$(BENCH_BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BENCH_BIN)/python -m pip install --quiet -e ".[bench]"
	$(BENCH_BIN)/python -m pip show trl transformers | grep -E '^(Name|Version)'
	touch $@

# The speed, memory and overhead benchmarks once each, on the CPU defaults (minutes each on a
# 2-core machine; GSM8K as for `run`).
bench: setup bench-venv
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python bench/grpo_iteration.py $(if $(GSM8K),--gsm8k $(GSM8K))
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BENCH_BIN)/python bench/vs_trl.py
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python bench/rollout.py
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python bench/scaling.py
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python bench/memory.py $(if $(GSM8K),--gsm8k $(GSM8K))
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/overhead.py $(if $(GSM8K),--gsm8k $(GSM8K))
