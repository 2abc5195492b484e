#!/bin/bash
# usage: bench/results/cpu-depth/command.sh [WORK] [OUT] — the run of docs/benchmarks.md "A deeper drafter on the small target"
# (the default's runs of these seeds are bench/results/cpu-kv-heads/base-s0 and base-s1: BASE=1 runs them again beside)
cd "$(dirname "$0")/../../.." || exit
BASE=${BASE:-0} PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/deep/w}" \
  "${2:-/tmp/deep/out}" deep4 "--drafter-layers 4" 0 1
echo "rc=$?"
BASE=0 PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/deep/w}" \
  "${2:-/tmp/deep/out}/three-layers" deep3 "--drafter-layers 3" 0 1
echo "rc=$?"
