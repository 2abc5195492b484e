#!/bin/bash
# usage: bench/results/cpu-depth/features/command.sh [WORK] [OUT] — the run of docs/benchmarks.md
# "Deeper target layers as features, or a layer more" (the default's runs of these seeds are
# bench/results/cpu-kv-heads/base-s0 and base-s1, the 3-layer ones on one target layer
# bench/results/cpu-depth/three-layers: on the CPU the same seeds repeat exactly)
cd "$(dirname "$0")/../../../.." || exit
BASE=0 PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/feat/w}" \
  "${2:-/tmp/feat/out}" feat012 "--feature-layers 0,1,2" 0 1
echo "rc=$?"
BASE=0 PYTHON=.venv/bin/python bench/compare_small_target.sh "${1:-/tmp/feat/w}" \
  "${2:-/tmp/feat/out}/deep3" feat012-deep3 "--feature-layers 0,1,2 --drafter-layers 3" 0 1
echo "rc=$?"
