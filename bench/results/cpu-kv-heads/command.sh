#!/bin/bash
# usage: bench/results/cpu-kv-heads/command.sh [WORK] [OUT] — the run of docs/benchmarks.md "More key/value heads at the same layers"
cd "$(dirname "$0")/../../.." || exit
C="--corpus-bytes 3000000 --vocab 2048 --target-layers 4 --target-hidden 128 --target-seq 128 --target-batch 16 --target-steps 600 --prompt-len 32 --gen-len 64 --gen-batch 256 --eval-prompts 16 --max-new-tokens 64 --unseen-every 0 --gen-temperatures 0 --gen-sampled-prefix 0"
D="--drafter-layers 2 --block-size 8 --drafter-batch 32 --anchors 16 --drafter-steps 400 --samples 4096 --train-data {work}/generated"
R=()
for s in 0 1 2; do
  R+=(--recipe "base-s$s: $C $D --set run.seed=$s")
  R+=(--recipe "kv2-s$s: $C $D --set run.seed=$s --set model.num_kv_heads=2")
done
.venv/bin/python bench/compare_recipes.py --work "${1:-/tmp/kv/w}" --out "${2:-/tmp/kv/out}" --prepare "$C --samples 4096" "${R[@]}"
echo "rc=$?"
