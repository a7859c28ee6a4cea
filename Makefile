# Two commands matter: `make demo` and `make test` (README quick start); `make test-fast` is the
# edit loop's subset (every test that starts no training process: tests/conftest.py), `make
# demo-quick` the minute-long LoRA demo (configs/e2v_tiny_lora.yaml) that reads its references but
# cannot generate.
# The venv sees system site-packages, so a CUDA torch already installed on the machine is used
# as it is; torch==$(TORCH_PIN) (the CPU wheel on this machine's disk) is installed only when no
# torch can be imported at all.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= 2.13.0
DEMO_DATA ?= demo_data
NUM_GPUS ?= 1
TEST_WORKERS ?= 2
export PYTHONUNBUFFERED := 1

DEMO_RAW ?= demo_raw
DEMO_PREP ?= demo_prep
# The launcher's rendezvous port: a port free when the recipe starts, so a second run on the same
# machine does not meet the first on deepspeed's fixed default (29500). `make demo MASTER_PORT=29600`
# (or MASTER_PORT in the environment) chooses one. TRAIN_ARGS: more flags for the demo runs, e.g.
# TRAIN_ARGS="--set train.max_steps=50".
MASTER_PORT ?= $(shell $(PY) -c 'from e2v.runtime.ports import free_port; print(free_port())')
TRAIN_ARGS ?=
DEEPSPEED = $(VENV)/bin/deepspeed --num_gpus $(NUM_GPUS) --master_port $(MASTER_PORT)

.PHONY: install lint demo demo-quick demo-prep demo-data test test-fast test-slow test-portable test-avx2 bench check-data clean-demo smoke-real gpu-check \
	gpu-wheels gpu-wheels-check

# The package is installed editable (pyproject.toml): the commands read configs/ and ds_configs/ from
# this checkout, and `e2v-check-dataset` & co. run the files in tools/ as they are.
$(VENV)/.installed: requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null && echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)') (kept)" \
		|| $(PY) -m pip install -q torch==$(TORCH_PIN)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

install: $(VENV)/.installed

# Always asked: the tool keeps a complete dataset with these parameters and rewrites any other.
demo-data: install
	$(PY) tools/make_demo_dataset.py $(DEMO_DATA)

# The demo trains from the conditioning cache (the encoders would double a step's time); the
# precompute keeps valid entries, so a second `make demo` goes straight to training.
demo: demo-data
	$(PY) tools/precompute.py --config configs/e2v_tiny.yaml --set data.datasets.0.data_root=$(DEMO_DATA)
	$(DEEPSPEED) train_e2v.py --config configs/e2v_tiny.yaml \
		--set data.datasets.0.data_root=$(DEMO_DATA) $(TRAIN_ARGS)

demo-quick: demo-data
	$(DEEPSPEED) train_e2v.py --config configs/e2v_tiny_lora.yaml \
		--set data.datasets.0.data_root=$(DEMO_DATA) $(TRAIN_ARGS)

# Raw footage in, a trained model out: generated multi-shot videos -> tools/prepare_data.py (and
# its dataset check) -> a short tiny LoRA run on the prepared set; prints the held-out
# shuffled-reference gap at the last validation (bench/demo_prep.py, docs/preparing_data.md).
demo-prep: install
	$(PY) bench/demo_prep.py --raw $(DEMO_RAW) --out $(DEMO_PREP) --num_gpus $(NUM_GPUS)

# The whole suite (tests/unit/ and tests/launch/, whose tests start processes: training runs, commands) on
# TEST_WORKERS pytest-xdist workers, a group at a time: a test file, or every user of one of the
# session's shared runs, in the order tests/conftest.py sorts them (the shared runs first).
test: install lint
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25 -m "not slow" tests

# ruff (pyproject.toml: pyflakes, pycodestyle errors, import order); `make lint FIX=--fix` sorts imports.
lint: install
	$(VENV)/bin/ruff check $(FIX) .

# The unit suite (the numerics: every comparison of two code paths, layouts or batchings) once under
# each family of CPU kernels PyTorch has for this machine, and once with MKL held to AVX2: a test
# that passes only with this CPU's rounding fails here, not on a user's machine (docs/architecture.md, "Tests").
# PORTABLE_CAPS: the ATEN_CPU_CAPABILITY values to run (avx512 only where the CPU has it). ~4 x 90 s.
PORTABLE_CAPS ?= default avx2 $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512)
test-portable: install
	@set -e; for cap in $(PORTABLE_CAPS); do \
		echo "== ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadgroup -p no:cacheprovider tests/unit; \
	done; \
	echo "== MKL_ENABLE_INSTRUCTIONS=AVX2"; \
	MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadgroup -p no:cacheprovider tests/unit

# CI's form of it (.ci/run, after make test): the kernels of an AVX2-only machine, PyTorch's and
# MKL's, in one pass of the unit suite.
test-avx2: install
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadgroup \
		-p no:cacheprovider tests/unit

# The GPU check's sections end to end at tiny sizes on CPU (bench/gpu_check.py --allow-cpu): ~3 min.
test-slow: install
	$(PY) -m pytest -q -x -m slow tests

# tests/unit/ (no training process) on TEST_WORKERS pytest-xdist workers, a test file each at a
# time (its module fixtures built once), one intra-op thread each (tests/conftest.py).
test-fast: install
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadgroup tests/unit

bench: install
	$(PY) bench/bench.py

# Real Wan2.1 shapes (random weights, built offline into smoke_real/) through the launcher on this
# machine's CPU: ~13 min, peak ~16 GiB (bench/smoke_real.py). Not part of `make test`.
smoke-real: install
	$(PY) bench/smoke_real.py

# On a CUDA machine: what a GPU user decides by, in at most 8 minutes -> bench/RESULTS_GPU.md
# (bench/gpu_check.py, docs/gpu.md); e.g. GPU_CHECK_ARGS="--budget 240" or "--only step_1.3b".
# No venv is made and requirements.txt is not installed: it runs with the interpreter it is given
# (PYTHON=..., else this checkout's .venv when there is one, else python3: the machine's CUDA torch),
# which installs only what does not import: from WHEELS=folder alone (pip --no-index), or nothing
# with NO_INSTALL=1. `make gpu-wheels` builds that folder (where there is network) for the GPU
# machine's Python and torch; `make gpu-wheels-check` proves one complete in a clean venv here.
GPU_CHECK_ARGS ?=
GPU_PYTHON = $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(PY)),$(PY),python3))
WHEELS ?=
GPU_PYTHON_VERSION ?= 3.12
GPU_TORCH ?= 2.8.0
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(if $(NO_INSTALL),--no-install) $(GPU_CHECK_ARGS)

gpu-wheels:
	$(GPU_PYTHON) bench/gpulib/packages.py wheels --out $(or $(WHEELS),wheels) --python-version $(GPU_PYTHON_VERSION) --torch $(GPU_TORCH)

gpu-wheels-check:
	$(GPU_PYTHON) bench/gpulib/packages.py venv-check --wheels $(or $(WHEELS),wheels)

CONFIG ?= configs/e2v_tiny.yaml
check-data: install
	$(PY) tools/check_dataset.py --config $(CONFIG)

clean-demo:
	rm -rf $(DEMO_DATA) $(DEMO_RAW) $(DEMO_PREP) $(DEMO_CAUSAL) runs

# The sequence layout's CPU demo (configs/r2v_tiny.yaml: SkyReels-V3 R2V's layout, references as
# clean latent slots after the video, on a tiny Wan2.1-style T2V with no CLIP; docs/conditioning.md):
# the same data and cache as `make demo`, then the held-out videos scored at 3 noise seeds (~15 min on 2 cores).
.PHONY: demo-r2v
demo-r2v: demo-data
	$(PY) tools/precompute.py --config configs/r2v_tiny.yaml --set data.datasets.0.data_root=$(DEMO_DATA)
	$(DEEPSPEED) train_e2v.py --config configs/r2v_tiny.yaml \
		--set data.datasets.0.data_root=$(DEMO_DATA) $(TRAIN_ARGS)
	$(PY) bench/seed_fidelity.py --run $$(ls -td runs/r2v_tiny-* | head -1) --seeds 0 1 2

# The causal task's CPU demo (configs/causal_tiny.yaml; docs/causal.md, "The demo"): the demo's clips
# with prompts naming the subject's colour, a tiny block-causal T2V trained by CausVid's regression,
# then its five-step block-by-block samples scored on the named colour at 3 noise seeds (~35 min on 2 cores;
# OMP_NUM_THREADS=1 on a machine shared with other jobs).
DEMO_CAUSAL ?= demo_causal
.PHONY: demo-causal
demo-causal: install
	$(PY) tools/make_demo_dataset.py $(DEMO_CAUSAL) --frames 21 --write-meta
	$(PY) bench/causal_demo.py prepare --data $(DEMO_CAUSAL)
	$(PY) tools/precompute.py --config configs/causal_tiny.yaml --set data.datasets.0.data_root=$(DEMO_CAUSAL)
	$(DEEPSPEED) train_e2v.py --config configs/causal_tiny.yaml \
		--set data.datasets.0.data_root=$(DEMO_CAUSAL) $(TRAIN_ARGS)
	$(PY) bench/causal_demo.py score --run $$(ls -td runs/causal_tiny-* | head -1) --seeds 0 1 2
