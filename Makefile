# `make run`: set up .venv (and tmux) and train the tiny demo drafter on this machine, in tmux, then
# follow its log; Ctrl-C detaches (the job keeps running) and ends `make run` without an error.
# `make test`: set up .venv (and the system tools the tests use), ruff, mypy, and the whole suite.
# `make lint`: ruff (lint and format), mypy, and shellcheck on the bash sent to places.
# bash runs the recipes: a command that handles Ctrl-C and exits is then not taken for the recipe's
# own interruption (dash ends itself with the signal).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup system-deps run-deps gpu-test bench clean

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
	$(BIN)/python -m pytest -q

gpu-test: setup
	$(BIN)/python -m pytest -q -m "gpu or gpu2" tests

lint: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python scripts/shellcheck-remote.py

clean:
	rm -rf $(VENV) .dflash .pytest_cache .mypy_cache
