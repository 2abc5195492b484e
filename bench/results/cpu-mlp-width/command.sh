#!/bin/bash
# usage: bench/results/cpu-mlp-width/command.sh [WORK] [OUT] — the run of docs/benchmarks.md "A wider MLP at the same layers"
cd "$(dirname "$0")/../../.." || exit
PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/mlp/w}" "${2:-/tmp/mlp/out}" \
  mlp1280 model.intermediate_size=1280 0 1 2
echo "rc=$?"
