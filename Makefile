# The README's two commands: `make fit` and `make test`. Both create .venv on first use.
# torch is installed first and pinned, so pip never pulls a multi-GB CUDA build on a fresh machine.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: fit test lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

fit: $(BIN)/.installed  ## refit gelu and silu (paper and floor families), print the error reports
	$(BIN)/invact-fit gelu --family paper
	$(BIN)/invact-fit silu --family paper
	$(BIN)/invact-fit gelu --family floor
	$(BIN)/invact-fit silu --family floor

test: $(BIN)/.installed  ## lint, then the whole test suite (everything that runs without a GPU)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
