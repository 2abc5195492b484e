#!/usr/bin/env bash
# The drafter's capacity at the same layers, on one target and one data set: the default beside
# its own key/value heads (plain multi-head attention) and beside a wider MLP; held-out τ of
# each, and each against the default paired over the same prompts (docs/benchmarks.md, "Twice
# the updates over the same answers": past ~250 K answers neither data nor steps moved it).
#   bench/compare_capacity.sh WORK OUT [bench_eval options for every recipe, e.g. --smoke]
# Environment: SAMPLES (262144), PAST_CAP (8000000: bytes of installed packages' sources beside
# the kept files as the drafter's prompts), KV (12: the benchmark target's query heads), MLP
# (4096: twice the target's), PYTHON (python3). One H200 runs the three drafters at once in about
# 30 minutes with the data (estimated from one drafter alone: 6.4 minutes; not yet run); two GPUs
# or more share them out (compare_recipes.py: recipe i on GPU i mod n).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 WORK OUT [bench_eval options]" >&2
  exit 2
fi
data="--samples ${SAMPLES:-262144} --unseen-past-cap ${PAST_CAP:-8000000} ${*:3}"
recipe="$data --train-data {work}/generated-unseen-t1-p16"
mkdir -p "$1" "$2"
exec "${PYTHON:-python3}" "$(dirname "$0")/compare_recipes.py" --work "$1" --out "$2" \
  --prepare "$data" \
  --recipe "base: $recipe" \
  --recipe "kv${KV:-12}: $recipe --set model.num_kv_heads=${KV:-12}" \
  --recipe "mlp${MLP:-4096}: $recipe --set model.intermediate_size=${MLP:-4096}"
