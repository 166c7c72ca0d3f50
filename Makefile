# The two commands of the README, and what they need. Works on a machine with only
# Python 3.11+: creates .venv, installs the pinned packages, then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888
PYTEST_ARGS ?=
# Each pass ends with its slowest tests, so a CI log says where the time went.
DURATIONS := --durations=25
# pytest workers of the parallel pass (pytest-xdist); the serial pass runs alone after it.
# Four on two cores: most test files wait more than they compute (hang timeouts,
# rendezvous, a browser), about 0.6-0.9 of a core each. Two workers left a core idle a
# third of the pass; with three it took 911 s, with four 799 s (2026-11-30, back to back
# on a fresh clone; the busiest half-minutes held 1.7-1.9 cores with four, where three
# had held 1.4-1.8; benchmarks/suite_timeline.py measures it).
PYTEST_WORKERS ?= 4
# JupyterLab refuses to run as root unless told; containers and CI machines often are root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab lab-learner learner-copy image image-cuda test test-gpu test-image setup system-deps benchmark clean

# The lock pins every package, so pip resolves nothing (--no-deps) and `pip check`
# proves nothing is missing. pip byte-compiles one file at a time: compileall does it on
# every core instead (a few template files in the packages are not Python, which pip's
# own compile step passes over too: hence || true).
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-deps --no-compile -r requirements.lock
	$(PY) -m pip check
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP) system-deps

# Debian packages some tests need (listed in scripts/system-packages.txt); installed
# with apt-get when missing, skipped when already there.
system-deps:
	./scripts/install-system-deps.sh

lab: setup
	$(VENV)/bin/jupyter lab $(ALLOW_ROOT) --ServerApp.port=$(PORT) --ServerApp.root_dir=. \
	    lessons/00_first_distributed_run.ipynb

# The course as learners get it, in build/learner: the lessons and every lab as `labutils
# release` writes it (no hidden checks, no wrong-fix catalogue, no solutions); `make lab`
# is the instructor's route, with all of them.
learner-copy: setup
	rm -rf build/learner
	$(PY) scripts/learner_copy.py build/learner

lab-learner: learner-copy
	cd build/learner && $(CURDIR)/$(VENV)/bin/jupyter lab $(ALLOW_ROOT) --ServerApp.port=$(PORT) \
	    --ServerApp.root_dir=. lessons/index.ipynb

# The learner's CPU image, built from the learner copy with podman and tried inside: no
# instructor material, lesson 00 under nbval, lab 01's solution graded (docker/build-local.sh;
# run as root). Not part of `make test`: it downloads Debian and Python packages.
image: setup
	./docker/build-local.sh

# The same for the CUDA image (docker/Dockerfile.cuda): torch's CUDA 13.0 build from PyPI,
# gigabytes of NVIDIA libraries; without a GPU its tries run on the CPU.
image-cuda: setup
	FLAVOR=cuda ./docker/build-local.sh

test-image: setup
	$(PY) -m pytest -m image -p no:cacheprovider tests/test_image.py $(PYTEST_ARGS)

# Lint and type-check src/, then the suite (without the image build: make test-image):
# everything that does not assert a time or a rate on every core (a test file stays on
# one worker: module fixtures run once; files are handed out in the order
# tests/conftest.py gives them, longest first, not xdist's by number of tests), then
# the serial tests and the lessons' notebooks that measure, on a quiet machine. pytest's status 5
# (nothing selected: PYTEST_ARGS named only serial or only parallel tests) is no failure.
test: setup
	$(VENV)/bin/ruff check src
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial and not image" $(DURATIONS) $(PYTEST_ARGS); \
	    status=$$?; [ $$status -eq 0 ] || [ $$status -eq 5 ]
	$(PY) -m pytest -m "serial and not image" $(DURATIONS) $(PYTEST_ARGS); status=$$?; [ $$status -eq 0 ] || [ $$status -eq 5 ]

# The GPU tests alone (NCCL, nn.DataParallel, the one-GPU parts of lessons 06 and 10, a
# notebook on CUDA), with the machine's own Python and its CUDA build of torch: the
# project's venv holds the CPU build, so no venv here, src/ on the path. Each test that
# needs more GPUs than the machine has is listed as skipped with what it needs.
GPU_PYTHON ?= python3
test-gpu:
	@$(GPU_PYTHON) -c "import torch, pytest" 2>/dev/null || { echo "make test-gpu: $(GPU_PYTHON) cannot import torch and pytest; install a CUDA build of torch and pytest for it, or name another: make test-gpu GPU_PYTHON=/path/to/python" >&2; exit 2; }
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -o addopts="" -p no:cacheprovider -rs -m gpu tests/test_gpu.py $(PYTEST_ARGS)

benchmark: setup
	$(PY) benchmarks/launcher.py

clean:
	rm -rf runs lessons/runs labs/*/runs tests/runs .pytest_cache test-artifacts
