# The README's two commands: `make fit` and `make test`. Both create .venv on first use, with every
# package at the version tests/constraints.txt pins (its header says how the pins move: `make pins`).
# torch is installed first, from TORCH_INDEX where one is given: on Linux PyPI's torch wheel is a CUDA
# build (several GB with its CUDA libraries); TORCH_INDEX=https://download.pytorch.org/whl/cpu takes
# the CPU build of the same release (its "+cpu" label satisfies the pin).
PYTHON ?= python3
PINS := tests/constraints.txt
TORCH ?= $(shell grep '^torch==' $(PINS))
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin

.PHONY: fit test test-full lint clean gpu gpu-quick compat pins

# The venv's constraints: the pins, with TORCH's line for torch's (the same line unless TORCH is given).
$(BIN)/.installed: pyproject.toml $(PINS)
	$(PYTHON) -m venv $(VENV)
	sed 's/^torch==.*/$(TORCH)/' $(PINS) > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt --upgrade pip
	$(BIN)/pip install -q -c $(VENV)/constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	# The toolkit's packages by their own names (fitting, codegen) for tests, notebooks and benchmarks:
	# the wheel installs them only inside invact (pyproject.toml says why), so the venv gets the checkout.
	$(BIN)/python -c 'import site, sys; open(site.getsitepackages()[0] + "/invact-checkout.pth", "w").write(sys.argv[1] + "\n")' "$(CURDIR)"
	touch $@

# The refits go to build/fit/, not coeffs/: the minimax step lands on slightly different coefficients
# on other CPUs (BLAS rounding; measured: gelu/paper left 9.08e-4 here against the committed 9.33e-4),
# and the committed coeffs/ must keep matching the committed invact/_generated/.
fit: $(BIN)/.installed  ## refit gelu, silu (paper, floor) and softplus (exact) into build/fit/, print the reports
	$(BIN)/invact-fit gelu --family paper --out build/fit/gelu/paper.json
	$(BIN)/invact-fit silu --family paper --out build/fit/silu/paper.json
	$(BIN)/invact-fit gelu --family floor --out build/fit/gelu/floor.json
	$(BIN)/invact-fit silu --family floor --out build/fit/silu/floor.json
	$(BIN)/invact-fit softplus --family exact --out build/fit/softplus/exact.json

test: $(BIN)/.installed  ## lint, then the test suite CI runs (everything that runs without a GPU)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

test-full: $(BIN)/.installed  ## the test suite with every row of its matrices (the "full" marker: CI checks a covering set)
	$(BIN)/python -m pytest -q -m "full or not full"

# The core tests (patch, plan, loss, norm, MLP, compile, CLI) at the ends of the supported torch and
# transformers range (invact/_versions.py), each in a venv of its own under .compat/ (kept: installing
# torch takes minutes; the first run downloads torch 2.11 and 2.15 with their CUDA libraries and
# installs three venvs of 5-6 GB each). Writes
# benchmarks/results/compat_cpu.json and .md. `make compat ONLY=newest` runs one environment.
compat: $(BIN)/.installed  ## the core tests at the supported range's ends (throwaway venvs in .compat/)
	$(BIN)/python tests/compat.py $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV)

# The pins afresh: `.[dev]` resolved from today's registry in a throwaway venv (build/pins; torch as TORCH
# says, PINS' own by default), frozen into $(PINS) with its header kept, written whole or not at all.
# Then `make test` and `make compat ONLY=newest`, and one commit with the bump and its compat row.
pins:  ## re-resolve tests/constraints.txt from today's registry (then make test, make compat ONLY=newest)
	rm -rf build/pins
	$(PYTHON) -m venv build/pins
	build/pins/bin/pip install -q --upgrade pip
	build/pins/bin/pip install -q $(TORCH)
	build/pins/bin/pip install -q -e '.[dev]'
	sed '/^[^#]/,$$d' $(PINS) > build/pins/constraints.txt
	build/pins/bin/pip freeze --all --exclude-editable | sed 's/^torch==\([^+]*\)+.*/torch==\1/' \
		>> build/pins/constraints.txt
	mv build/pins/constraints.txt $(PINS)
	rm -rf build/pins

# Every GPU check in one command: CUDA tests, kernel tuning sweep, the paper's time table (fp32, bf16)
# and peak memory of training steps; results in benchmarks/results/. Uses the python that has a CUDA
# torch (PYTHON=...); PARTS="tests tune" runs some parts only.
gpu:  ## the GPU suite (needs a CUDA device)
	PYTHON=$(PYTHON) bash benchmarks/gpu_suite.sh $(PARTS)

# The short GPU check (benchmarks/gpu_quick.py: the Llama-shaped step eager / patch() / compiled /
# compiled + patch(), head + loss at Llama-3.2-1B's shape against its three matmuls, host time per op
# kind, the compiled patched step's top host costs, whole training steps at real shapes). Run it first
# whenever a GPU is at hand. It runs the head + loss and the whole steps first, then the rest, within
# a budget of seconds (--budget, default 200: 4 minutes with the start and a first check of the gated
# MLP kernels in every dtype): a part or step row that the longest of its kind so far would push past
# it is skipped and listed under "skipped" in its JSON.
gpu-quick:  ## the short GPU check (needs a CUDA device)
	PYTHON=$(PYTHON) bash benchmarks/gpu_suite.sh quick
