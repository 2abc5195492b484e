#!/usr/bin/env bash
# One target with every K-th file kept from it; the drafter trained on its answers to its own
# files and, beside it, to the kept files; held-out τ of both (docs/benchmarks.md, "The
# drafter's prompts from files the target never learnt").
#   bench/compare_prompt_sources.sh WORK OUT [bench_eval options for both, e.g. --smoke]
# Environment: K (default 4), SAMPLES (49152), STEPS (1200), FEATURES (1,2,4,5,6: the target
# layers the drafter reads), PYTHON (python3).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 WORK OUT [bench_eval options]" >&2; exit 2; }
work=$1 out=$2; shift 2
bench=$(dirname "$0")
py=${PYTHON:-python3}
mkdir -p "$work" "$out"
data=(--samples "${SAMPLES:-49152}" --gen-temperatures 1 --gen-sampled-prefix 16
      --unseen-every "${K:-4}" "$@")
"$py" "$bench/bench_eval.py" --work "$work" --prepare-only --out "$out/prepare-unseen.json" \
  "${data[@]}" --drafter-prompts unseen-files > "$out/prepare-unseen.log" 2>&1
"$py" "$bench/bench_eval.py" --work "$work" --prepare-only --out "$out/prepare-target.json" \
  "${data[@]}" --reuse-target --drafter-prompts target-files > "$out/prepare-target.log" 2>&1
recipe="--feature-layers ${FEATURES:-1,2,4,5,6} --samples ${SAMPLES:-49152}"
recipe="$recipe --drafter-steps ${STEPS:-1200} $*"
own="--train-data {work}/generated-t1-p16 --drafter-prompts target-files"
kept="--train-data {work}/generated-unseen-t1-p16 --drafter-prompts unseen-files"
exec "$py" "$bench/compare_recipes.py" --work "$work" --out "$out" --skip-prepare \
  --recipe "target-files: $recipe $own" --recipe "unseen-files: $recipe $kept"
