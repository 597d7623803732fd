# make demo: train a GPT three ways side by side (no offload, per-block checkpointing, tba's
#   defaults): peak memory, step time, loss parity, and a plot of memory over a step in demo-out/.
# make lint: ruff, ruff format, the layers contract and mypy (.pre-commit-config.yaml: the same).
# make test: lint, then the whole test suite, then the GPU check's dry run (< 1 min, no GPU).
# make gpu-check: on a GPU machine whose python has torch with CUDA (no venv, no network):
#   benchmarks/gpu/check.sh, BUDGET_S seconds at most (default 540); results in gpu-check-out/.
# make gpu-wheels: fetch the kvikio and torchtune wheels the GPU check installs into gpu-wheels/
#   (benchmarks/gpu/carry.sh; needs the package registry); benchmarks/gpu/run_check.sh runs
#   the check with them and packs its results.
# Both create .venv when it is missing and install the pinned CPU build of torch first
# (a plain `pip install torch` could pull a multi-GB CUDA build).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: demo test lint bench clean gpu-check gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml setup.py $(wildcard native/*) | $(PY)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e .
	touch $@

# The integration tests need the real frameworks (the integrations extra, exact versions);
# the constraint keeps pip from replacing the pinned torch build while resolving them.
$(VENV)/.test: $(VENV)/.base
	echo "$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt -e ".[test,integrations]"
	touch $@

# The demo's plot needs matplotlib (the plot extra). Without it (offline, say) the demo still
# prints its table and says how to install it; the install is tried again on the next run.
$(VENV)/.plot: $(VENV)/.base
	echo "$(TORCH)" > $(VENV)/torch-constraint.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt -e ".[plot]" && touch $@ \
		|| echo "make demo: matplotlib did not install; the demo runs without its plot"

demo: $(VENV)/.plot
	$(PY) examples/train_gpt.py

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache  # the layering in pyproject.toml [tool.importlinter]
	$(VENV)/bin/mypy  # over tba/, at the strictness of pyproject.toml [tool.mypy]

test: lint
	$(PY) -m pytest -q
	PYTHON=$(PY) OUT_DIR=gpu-check-out/dry benchmarks/gpu/check.sh --dry

# Uses the machine's python (PYTHON, default python3) as it is: it must have torch with CUDA.
gpu-check:
	PYTHON=$(PYTHON) benchmarks/gpu/check.sh

gpu-wheels:
	PYTHON=$(PYTHON) benchmarks/gpu/carry.sh

bench: $(VENV)/.base
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache tba/_engine*.so gpu-check-out \
		demo-out
