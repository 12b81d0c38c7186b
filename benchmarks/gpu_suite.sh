#!/usr/bin/env bash
# Every GPU measurement of tutorials/performance.md, one after the other, each with a time limit;
# JSON (each with its command, date and machine) and logs go to the folder given (default bench-out/), to be
# kept as dated files under benchmarks/results/. Run from the repository root on a GPU machine:
#
#     bash benchmarks/gpu_suite.sh bench-out                          # everything (well over 10 minutes)
#     bash benchmarks/gpu_suite.sh bench-out gpu_tests,train_2048     # only the steps named
#
# flash-linear-attention autotunes its kernels on first use (many minutes). first_step.py runs it first,
# with an empty Triton cache of its own (out/triton-cache), and records that cold start as the peer's
# time to first step; fla_precompile.py then compiles the rest of its candidates in parallel into the same
# cache, so that the later comparisons measure its steady state (it still autotunes over every candidate).
set -u
out="${1:-bench-out}"
only="${2:-}"  # comma-separated step names; empty: all
mkdir -p "$out"
cache="$(cd "$out" && pwd)/triton-cache"
export PYTHONUNBUFFERED=1

step() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then return; fi
    echo "== $name (at most ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "   exit code $? ($(date +%T)); log: $out/$name.log"
}

# the tests that run on CUDA: the kernels against their references, decoding, pretrain runs with the GPU's
# defaults (CUDA graphs included), the export to flash-linear-attention's model
step gpu_tests 1800 python -m pytest -q -p no:cacheprovider tests/test_gla_triton.py tests/test_gla_triton_gpu.py \
    tests/test_norm.py tests/test_swiglu.py tests/test_cross_entropy.py tests/test_launch.py tests/test_model_fused.py \
    tests/test_generate.py tests/test_pretrain_resume.py tests/test_convert_fla_gpu.py tests/test_gdn_triton.py \
    tests/test_short_conv.py tests/test_gdn_recurrent.py tests/test_fp8.py tests/test_gdn_delta_rule.py tests/test_gdn_model.py \
    tests/test_deltanet.py tests/test_chunked.py tests/test_gla_tune.py tests/test_fp8_matmul.py tests/test_fp8_products.py tests/test_learning_parity.py
step first_step 900 python benchmarks/first_step.py --fla_cache_dir "$cache" --out "$out/first_step.json"
step fla_precompile 900 env TRITON_CACHE_DIR="$cache" python benchmarks/fla_precompile.py --workers 6 \
    --out "$out/fla_precompile.json"
step gla_kernel 900 env TRITON_CACHE_DIR="$cache" python benchmarks/gla_kernel.py --sweep --out "$out/gla_kernel.json"
step gate_cumsum 120 env TRITON_CACHE_DIR="$cache" python benchmarks/gate_cumsum.py --out "$out/gate_cumsum.json"
step fused_ops 300 env TRITON_CACHE_DIR="$cache" python benchmarks/fused_ops.py --out "$out/fused_ops.json"
step short_conv 300 env TRITON_CACHE_DIR="$cache" python benchmarks/short_conv.py --out "$out/short_conv.json"
step train_2048 1200 env TRITON_CACHE_DIR="$cache" python benchmarks/train_throughput.py --profile 2 \
    --models fabric-lin,fabric-lin-tuned,fla,transformer,fabric-lin-static,fabric-lin-no-cudagraphs --out "$out/train_2048.json"
# the peer's candidates at 16K too (half the micro batch of the 2048 step, so 8 workers fit on one GPU)
step fla_precompile_16k 600 env TRITON_CACHE_DIR="$cache" python benchmarks/fla_precompile.py --workers 8 --batch_size 1 \
    --seq_len 16384 --worker_gib 16 --out "$out/fla_precompile_16k.json"
step train_16k 900 env TRITON_CACHE_DIR="$cache" python benchmarks/train_throughput.py --batch_size 2 --seq_len 16384 \
    --regimes bf16-weights,real-loop --out "$out/train_16k.json"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    # 1 GPU and 2 GPUs, one step after the other, each optimizer step 4 micro-batches per GPU
    step train_1gpu_acc4 300 python benchmarks/train_throughput.py --regimes real-loop --models fabric-lin \
        --accumulation 4 --steps 8 --warmup 3 --out "$out/train_1gpu_acc4.json"
    step train_2gpu 600 python benchmarks/train_throughput.py --regimes real-loop --models fabric-lin,fabric-lin-fsdp-block,fabric-lin-fsdp-block-reshard,fabric-lin-ddp \
        --devices 2 --accumulation 4 --steps 8 --warmup 3 --out "$out/train_2gpu.json"
    step profile_2gpu 300 python benchmarks/profile_step.py --devices 2 --out "$out/profile_2gpu.json"
fi
# the real loop's step on one GPU, GPU time by kind of kernel (beside regime (a)'s --profile above)
step profile_1gpu 300 python benchmarks/profile_step.py --devices 1 --out "$out/profile_1gpu.json"
# where the host's time per step goes (micro batch 1: the GPU's work is small, the host's is not)
step profile_host 300 python benchmarks/profile_step.py --batch_size 1 --host_ops --out "$out/profile_host.json"
step activation_memory 300 python benchmarks/activation_memory.py --out "$out/activation_memory.json"
# learning parity with fla, from the same weights on the same batches, beside our model on its reference ops in bf16
# (the drift of rounding alone) and our fp32 run as the yardstick (fla's kernels compiled by the steps above)
step parity_gla 1200 env TRITON_CACHE_DIR="$cache" python benchmarks/learning_parity.py --model gla-340M \
    --peers fla reference-bf16 fp32 \
    --out "$out/parity_gla.json" --plot "$out/parity_gla.png"
step parity_gdn 1200 env TRITON_CACHE_DIR="$cache" python benchmarks/learning_parity.py --model gdn-340M --peers fla fp32 \
    --out "$out/parity_gdn.json" --plot "$out/parity_gdn.png"
# FP8 (compute capability 8.9+): the fused ops' FP8 products against bf16 by kind of kernel; the step in FP8 (in the
# fused ops, and torchao's) against fla's and our bf16 one, at gla-340M and gla-1.3B; 300 steps of FP8 against bf16
# from the same weights on the same batches (the plot needs matplotlib)
step fp8_products 300 python benchmarks/fp8_products.py --model gla-1.3B --out "$out/fp8_products.json"
step train_fp8 1500 env TRITON_CACHE_DIR="$cache" python benchmarks/train_throughput.py --regimes bf16-weights,real-loop \
    --models fla,fabric-lin,fabric-lin-compiled,fabric-lin-fp8,fabric-lin-fp8-fused \
    --out "$out/train_fp8.json"
step train_fp8_1b 1200 python benchmarks/train_throughput.py --regimes bf16-weights,real-loop \
    --models gla-1B-compiled,gla-1B,gla-1B-fp8,gla-1B-fp8-fused --timeout 400 --out "$out/train_fp8_1b.json"
step parity_fp8 1200 python benchmarks/learning_parity.py --model gla-340M --steps 300 --peers fp8-fused fp32 \
    --out "$out/parity_fp8.json" --plot "$out/parity_fp8.png"
# the gated delta rule at issue 48's shapes (the gdn-340M and gdn-1.3B layers, 16 heads at 8K, 32K), every gate
# family; 32K tokens as 64 documents; DeltaNet's delta rule against fla's chunk_delta_rule
step gdn_kernel 900 env TRITON_CACHE_DIR="$cache" python benchmarks/gdn_kernel.py --gates init slow fast \
    --shapes 16,2048,4,128,256 4,8192,16,128,128 1,32768,8,128,128 16,2048,6,256,512 --out "$out/gdn_kernel.json"
step gdn_varlen 300 env TRITON_CACHE_DIR="$cache" python benchmarks/gdn_kernel.py --gates init slow fast \
    --shapes 1,32768,8,128,128 --varlen 64 --out "$out/gdn_varlen.json"
step delta_rule_kernel 300 env TRITON_CACHE_DIR="$cache" python benchmarks/gdn_kernel.py --gates none --out "$out/delta_rule_kernel.json"
# the context-length table: transformer-340M, gla-340M and gdn-340M at equal tokens per step (32K), regime (a)
for ctx in 2048:16 8192:4 16384:2 32768:1; do
    step "context_${ctx%%:*}" 900 env TRITON_CACHE_DIR="$cache" python benchmarks/train_throughput.py --regimes bf16-weights \
        --models transformer,fabric-lin,gdn --seq_len "${ctx%%:*}" --batch_size "${ctx##*:}" --steps 10 --warmup 3 \
        --out "$out/context_${ctx%%:*}.json"
done
# the seed notes' long-document table: every family at 2K to 32K context on the long-document corpus, a family a
# step, each cell merged into the one JSON as it ends
for family in transformer gla gdn deltanet; do
    step "long_context_$family" 900 env TRITON_CACHE_DIR="$cache" python benchmarks/long_context.py --families "$family" \
        --out "$out/long_context.json"
done
