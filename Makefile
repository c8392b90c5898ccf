# `make run` and `make test` are all a fresh machine needs: both build the environments on first use.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The framework environments to build, test, run and open (the tools environment always comes along): by default
# those already installed, or all of them on a fresh machine. make setup FRAMEWORKS="pytorch" on a workshop laptop that
# runs the PyTorch notebooks only; from then on make run, lab and test work with that one.
ALL_FRAMEWORKS := pytorch tensorflow mxnet-chainer jax
INSTALLED := $(strip $(foreach env,$(ALL_FRAMEWORKS),$(if $(wildcard .venvs/$(env)/.installed),$(env))))
FRAMEWORKS ?= $(or $(INSTALLED),$(ALL_FRAMEWORKS))
# GPU=1 forces the CUDA builds, GPU=0 the CPU ones; by default nvidia-smi decides. DRIVER=535.104.05 plans for that
# driver instead of the installed one (a Docker build sees none).
GPU ?= auto
TOOLS := .venvs/tools/bin/python
export FRAMEWORKS

.PHONY: setup run test lab lint lock prepare bench-loader bench-live bench-shm bench-first-step readme readme-setup workshop clean

# Skips every environment whose lock has not changed since it was installed (envs/install.py).
setup:
	@$(PYTHON) envs/install.py --gpu $(GPU) $(if $(DRIVER),--driver $(DRIVER)) $(FRAMEWORKS)

# DATA_DIR=/path/to/chestxray14 make run  uses the real data; extra options: RUN_ARGS="--devices 1 2 4"
run: setup
	$(TOOLS) -m common.run $(if $(DATA_DIR),--data-dir "$(DATA_DIR)") $(RUN_ARGS)

# pytest once in each environment (tests/conftest.py says which tests run where): each framework's tests/<framework>/
# folder in its own, the three side by side (their output follows when all are done), then the framework-neutral tests
# and the notebooks, through each environment's kernel, in the tools. PYTEST_ARGS go to every run; a run they leave
# without tests passes.
test: setup
	@logs=$$(mktemp -d); status=0; \
	for env in $(FRAMEWORKS); do \
		( .venvs/$$env/bin/python -m pytest --durations=10 $(PYTEST_ARGS) > $$logs/$$env.log 2>&1; \
		  echo $$? > $$logs/$$env.code ) & \
	done; wait; \
	for env in $(FRAMEWORKS); do \
		echo "== pytest in the $$env environment"; cat $$logs/$$env.log; code=$$(cat $$logs/$$env.code); \
		if [ $$code -ne 0 ] && ! { [ $$code -eq 5 ] && [ -n "$(PYTEST_ARGS)" ]; }; then status=1; fi; \
	done; rm -rf $$logs; \
	echo "== pytest in the tools environment"; \
	.venvs/tools/bin/python -m pytest --durations=25 $(PYTEST_ARGS); code=$$?; \
	if [ $$code -ne 0 ] && ! { [ $$code -eq 5 ] && [ -n "$(PYTEST_ARGS)" ]; }; then status=1; fi; \
	exit $$status

# Checks every image of DATA_DIR once and writes the copy every notebook trains from (IMAGE_SIZE=224 by default).
prepare: setup
	$(TOOLS) -m common.data prepare "$(or $(DATA_DIR),$(error set DATA_DIR=/path/to/chestxray14))" $(if $(IMAGE_SIZE),--image-size $(IMAGE_SIZE))

lab: setup
	@$(TOOLS) -m common.run --list
	.venvs/tools/bin/jupyter lab notebooks

lint: setup
	$(TOOLS) -m ruff check common tests notebooks envs
	$(TOOLS) -m ruff format --check common tests envs
	$(TOOLS) tests/notebook_repeats.py

# Writes envs/*/*.txt (every package pinned) and envs/*/environment.yml from envs/*/*.in.
lock: setup
	$(TOOLS) envs/lock.py

# Prints the figures and writes them into README.md's bench-loader block.
bench-loader: setup
	$(TOOLS) -m common.measure.bench_loader --readme README.md $(BENCH_ARGS)

# Measures what the live device view costs the training it watches, in a real kernel, and writes it into README.md.
bench-live: setup
	$(TOOLS) -m common.measure.bench_live --readme README.md $(BENCH_ARGS)

# Measures the shared memory (/dev/shm) one training process's data loader holds, and writes it into docker/README.md.
bench-shm: setup
	.venvs/pytorch/bin/python -m common.pytorch.shared_memory --readme docker/README.md $(BENCH_ARGS)

# The TensorFlow notebooks' first training step (tracing, then the graph's first run), Keras' Adam against tfu.Adam.
bench-first-step: setup
	.venvs/tensorflow/bin/python -m common.tensorflow.first_step --readme README.md $(BENCH_ARGS)

# Copies the table of the newest runs/<timestamp>/report.md (or RUN=...) into README.md.
readme: setup
	$(TOOLS) -m common.measure.report --readme README.md $(or $(RUN),$(patsubst %/,%,$(lastword $(sort $(dir $(wildcard runs/*/report.md))))))

# Writes the set-up time and disk of each environment, as make setup recorded them, into README.md.
readme-setup: setup
	$(TOOLS) -m common.measure.report --readme README.md --setup

# Writes docs/workshop.md with the times and figures of the newest make run (or RUN=...).
workshop: setup
	$(TOOLS) -m common.teach.workshop $(or $(RUN),$(patsubst %/,%,$(lastword $(sort $(dir $(wildcard runs/*/report.md))))))

clean:
	rm -rf .venvs runs build .pytest_cache
