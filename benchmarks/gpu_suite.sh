#!/usr/bin/env bash
# Every GPU measurement behind tutorials/performance.md, one after the other, each with a time limit;
# JSON and logs go to the folder given (default bench-out/). Run from the repository root on a GPU machine:
#
#     bash benchmarks/gpu_suite.sh bench-out
#
# flash-linear-attention autotunes its kernels on first use (minutes). Its results are cached in
# TRITON_CACHE_DIR, so the peer's start-up is paid once, in the first step that runs it (first_step.py
# records that start-up as the peer's time to first step); later steps reuse the cache.
set -u
out="${1:-bench-out}"
mkdir -p "$out"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/cache}" PYTHONUNBUFFERED=1

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit code $? ($(date +%T)); log: $out/$name.log"
}

step gpu_tests 600 python -m pytest -q -p no:cacheprovider tests/test_gla_triton.py tests/test_fused_ops.py tests/test_model_fused.py
step first_step 900 python benchmarks/first_step.py --fla_cache_dir "$TRITON_CACHE_DIR" --out "$out/first_step.json"
step gla_kernel 900 python benchmarks/gla_kernel.py --sweep --out "$out/gla_kernel.json"
step train_2048 900 python benchmarks/train_throughput.py --out "$out/train_2048.json"
step train_16k 600 python benchmarks/train_throughput.py --batch_size 2 --seq_len 16384 --models fabric-lin,fla,transformer \
    --regimes bf16-weights,real-loop --out "$out/train_16k.json"
step activation_memory 300 python benchmarks/activation_memory.py
