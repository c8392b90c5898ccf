# `make run` and `make test` are all a fresh machine needs: both set up .venv on first use.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# GPU=1 forces the CUDA builds, GPU=0 the CPU ones; by default nvidia-smi decides.
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)
STAMP := $(VENV)/.installed-$(if $(filter 1,$(GPU)),gpu,cpu)

.PHONY: setup run test lab lint prepare bench-loader bench-live readme workshop clean

setup: $(STAMP)

# Re-runs only when a requirements file or pyproject.toml changed since the last install.
$(STAMP): requirements.txt requirements-build.txt requirements-gpu.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check pip==26.3
	$(PY) -m pip install --build-constraint requirements-build.txt -r requirements.txt
ifeq ($(GPU),1)
	$(PY) -m pip uninstall --yes mxnet
	$(PY) -m pip install -r requirements-gpu.txt
endif
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -m common.kernel
	@rm -f $(VENV)/.installed-* && touch $@

# DATA_DIR=/path/to/chestxray14 make run  uses the real data; extra options: RUN_ARGS="--devices 1 2 4"
run: setup
	$(PY) -m common.run $(if $(DATA_DIR),--data-dir "$(DATA_DIR)") $(RUN_ARGS)

test: setup
	$(PY) -m pytest --durations=25 $(PYTEST_ARGS)

# Checks every image of DATA_DIR once and writes the copy every notebook trains from (IMAGE_SIZE=224 by default).
prepare: setup
	$(PY) -m common.prepare "$(or $(DATA_DIR),$(error set DATA_DIR=/path/to/chestxray14))" $(if $(IMAGE_SIZE),--image-size $(IMAGE_SIZE))

lab: setup
	$(VENV)/bin/jupyter lab notebooks

lint: setup
	$(VENV)/bin/ruff check common tests notebooks
	$(VENV)/bin/ruff format --check common tests
	$(PY) tests/notebook_repeats.py

# Prints the figures and writes them into README.md's bench-loader block.
bench-loader: setup
	$(PY) -m common.bench_loader --readme README.md $(BENCH_ARGS)

# Measures what the live device view costs the training it watches, in a real kernel, and writes it into README.md.
bench-live: setup
	$(PY) -m common.bench_live --readme README.md $(BENCH_ARGS)

# Copies the table of the newest runs/<timestamp>/report.md (or RUN=...) into README.md.
readme: setup
	$(PY) -m common.report --readme README.md $(or $(RUN),$(patsubst %/,%,$(lastword $(sort $(dir $(wildcard runs/*/report.md))))))

# Writes docs/workshop.md with the times and figures of the newest make run (or RUN=...).
workshop: setup
	$(PY) -m common.workshop $(or $(RUN),$(patsubst %/,%,$(lastword $(sort $(dir $(wildcard runs/*/report.md))))))

clean:
	rm -rf $(VENV) runs build .pytest_cache
