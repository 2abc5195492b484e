#!/usr/bin/env bash
# The drafter's capacity, on one target and one data set: the default beside its own key/value
# heads (plain multi-head attention), a wider MLP, both, or more layers; held-out τ of each, and
# each against the first recipe's paired over the same prompts (docs/benchmarks.md, "Twice the
# updates over the same answers": past ~250 K answers neither data nor steps moved it; "More
# key/value heads and a wider MLP at the same layers": nor did width).
#   bench/compare_capacity.sh WORK OUT [bench_eval options for every recipe, e.g. --smoke]
# Environment: RECIPES (which, in this order: "base kv mlp" by default; also kvmlp, both at
# once, deep, DEPTH layers instead of 4, and deepN, N layers: "base deep6 deep5"),
# ONE_AT_A_TIME (set: the recipes one after another, each result kept as it lands, instead of
# all sharing the GPUs at once), SAMPLES (262144),
# PAST_CAP (8000000: bytes of installed packages' sources beside the kept files as the drafter's
# prompts), KV (12: the benchmark target's query heads), MLP (4096: twice the target's), DEPTH
# (6), PYTHON (python3). Two GPUs or more share the recipes out (compare_recipes.py: recipe i on
# GPU i mod n).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 WORK OUT [bench_eval options]" >&2
  exit 2
fi
kv=${KV:-12}
mlp=${MLP:-4096}
depth=${DEPTH:-6}
data="--samples ${SAMPLES:-262144} --unseen-past-cap ${PAST_CAP:-8000000} ${*:3}"
recipe="$data --train-data {work}/generated-unseen-t1-p16"
recipes=()
for name in ${RECIPES:-base kv mlp}; do
  case "$name" in
    base) recipes+=(--recipe "base: $recipe") ;;
    kv) recipes+=(--recipe "kv$kv: $recipe --set model.num_kv_heads=$kv") ;;
    mlp) recipes+=(--recipe "mlp$mlp: $recipe --set model.intermediate_size=$mlp") ;;
    kvmlp) recipes+=(--recipe "kv$kv-mlp$mlp: $recipe --set model.num_kv_heads=$kv \
--set model.intermediate_size=$mlp") ;;
    deep|deep[1-9]|deep[1-9][0-9])
      n=${name#deep}; n=${n:-$depth}
      recipes+=(--recipe "layers$n: $recipe --set model.num_layers=$n") ;;
    *) echo "$0: unknown recipe '$name' in RECIPES (base, kv, mlp, kvmlp, deep, deepN)" >&2
      exit 2 ;;
  esac
done
order=()
if [ -n "${ONE_AT_A_TIME:-}" ]; then order=(--one-at-a-time); fi
mkdir -p "$1" "$2"
exec "${PYTHON:-python3}" "$(dirname "$0")/compare_recipes.py" --work "$1" --out "$2" \
  --prepare "$data" "${order[@]}" "${recipes[@]}"
