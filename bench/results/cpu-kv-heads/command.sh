#!/bin/bash
# usage: bench/results/cpu-kv-heads/command.sh [WORK] [OUT] — the run of docs/benchmarks.md "More key/value heads at the same layers"
cd "$(dirname "$0")/../../.." || exit
PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/kv/w}" "${2:-/tmp/kv/out}" \
  kv2 model.num_kv_heads=2 0 1 2
echo "rc=$?"
