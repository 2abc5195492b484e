#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmarks in one go, on a machine with CUDA and PyTorch.
#   scripts/gpu-suite.sh [tests|bench|profile|all] [PYTEST ARGS…]     (default: all)
# PYTEST ARGS pick which tests run (default: every test marked gpu or gpu2 under tests/); a cold
# H200 needs about 15 minutes for them all, so a machine that ends each call sooner runs them in
# parts, e.g. `tests tests/gpu/test_[a-o]*.py` then `tests tests/gpu/test_[p-z]*.py tests/ops`.
# profile: where a drafter step spends its GPU time, with its layers compiled and eager, with two
# sequences a step in two parts (data.micro_batches: one optimizer step for both), and with the
# CuTe-DSL attention kernels where flash-attn-4 imports.
# Results go to $OUT (or ./gpu-results): pytest log, one JSON per benchmark.
# Wheels in .whl/ (peers for the benchmarks, or packages the machine lacks) are installed into a
# private folder first, so a machine without network can run it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
what=${1:-all}
shift $(($# > 0))
picked=("$@")
[ ${#picked[@]} -gt 0 ] || picked=(tests)
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dflash-site .whl/*.whl \
    && export PYTHONPATH=/tmp/dflash-site${PYTHONPATH:+:$PYTHONPATH}
  # nvidia-cutlass-dsl puts its modules on the path with a .pth file, which --target skips
  dsl=/tmp/dflash-site/nvidia_cutlass_dsl/dsl_packages
  [ -d "$dsl" ] && export PYTHONPATH=$PYTHONPATH:$dsl
fi
flash=()  # FlexAttention's CuTe-DSL rows, where flash-attn-4 imports
$PY -c 'import flash_attn.cute' 2>/dev/null && flash=(--flash)
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  $PY -m pytest -q -m "gpu or gpu2" "${picked[@]}" 2>&1 | tee "$out/gpu-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for name in bench_attention bench_loss bench_eval bench_evaluate bench_pipeline bench_generate \
    bench_train_loop; do
    # (bench_cli is CPU-only)
    b=bench/$name.py
    extra=()
    [ "$name" = bench_attention ] && extra=("${flash[@]}")
    $PY "$b" "${extra[@]}" --out "$out/$name.json" 2>&1 | tee "$out/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  if [ ${#flash[@]} -gt 0 ]; then  # the split again, the drafter on the CuTe-DSL kernels
    $PY bench/bench_pipeline.py --attention-kernels flash --out "$out/bench_pipeline-flash.json" 2>&1 \
      | tee "$out/bench_pipeline-flash.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
  for mode in on off; do
    $PY bench/profile_drafter.py --compile $mode --out "$out/profile-compile-$mode.json" 2>&1 \
      | tee "$out/profile-compile-$mode.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  $PY bench/profile_drafter.py --batch-size 2 --micro-batches 2 --out "$out/profile-parts.json" \
    2>&1 | tee "$out/profile-parts.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ ${#flash[@]} -gt 0 ]; then  # the drafter step with FlexAttention's CuTe-DSL kernels
    $PY bench/profile_drafter.py --attention-kernels flash --out "$out/profile-flash.json" 2>&1 \
      | tee "$out/profile-flash.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi
exit "$status"
