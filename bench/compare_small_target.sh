#!/usr/bin/env bash
# One drafter setting beside the default, seed by seed, on the small CPU target of
# docs/benchmarks.md ("A wider MLP at the same layers", "More key/value heads at the same
# layers"): a Qwen3 of 4 layers × 128 trained 600 steps on 3 MB of the standard library, its
# 4,089 greedy answers, 2-layer drafters, B = 8, 400 steps; 16 held-out prompts × 64 tokens.
#   bench/compare_small_target.sh WORK OUT NAME SETTING SEED…
#   e.g. bench/compare_small_target.sh /tmp/w /tmp/r kv2 model.num_kv_heads=2 0 1 2
#        bench/compare_small_target.sh /tmp/w /tmp/r deep4 "--drafter-layers 4" 0 1
# SETTING: KEY=VALUE (a `--set` override) or bench_eval options. Recipes base-s<seed> and
# NAME-s<seed>, all at once. Environment: PYTHON (python3), BASE (0: leave the base-s<seed>
# recipes out, e.g. when they are on record already: on the CPU the same seeds repeat exactly).
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 WORK OUT NAME KEY=VALUE SEED…" >&2
  exit 2
fi
target="--corpus-bytes 3000000 --vocab 2048 --target-layers 4 --target-hidden 128"
target+=" --target-seq 128 --target-batch 16 --target-steps 600 --prompt-len 32 --gen-len 64"
target+=" --gen-batch 256 --eval-prompts 16 --max-new-tokens 64 --unseen-every 0"
target+=" --gen-temperatures 0 --gen-sampled-prefix 0"
drafter="--drafter-layers 2 --block-size 8 --drafter-batch 32 --anchors 16 --drafter-steps 400"
drafter+=" --samples 4096 --train-data {work}/generated"
case "$4" in
  --*) setting="$4" ;;
  *=*) setting="--set $4" ;;
  *) echo "$0: SETTING must be KEY=VALUE or bench_eval options, got '$4'" >&2; exit 2 ;;
esac
recipes=()
for seed in "${@:5}"; do
  if [ "${BASE:-1}" != 0 ]; then
    recipes+=(--recipe "base-s$seed: $target $drafter --set run.seed=$seed")
  fi
  recipes+=(--recipe "$3-s$seed: $target $drafter --set run.seed=$seed $setting")
done
exec "${PYTHON:-python3}" "$(dirname "$0")/compare_recipes.py" --work "$1" --out "$2" \
  --prepare "$target --samples 4096" "${recipes[@]}"
