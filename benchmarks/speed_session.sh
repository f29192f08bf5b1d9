#!/usr/bin/env bash
# Issue 21's measurements on ONE H200, stage by stage, each bounded, results under $OUT after each:
#   STAGES="attention trace variants" bash benchmarks/speed_session.sh
# attention: benchmarks/attention_kernels.py (every attention kernel on Flash's MLA and Air's GQA shapes)
# trace:     one profiled step of each of $TRACE_VARIANT (default GLM-4.7-Flash's; Chrome trace + top kernels) and
#            its idle gaps (trace_gaps.py); TRACE_LIMIT bounds the stage (120 s); TRACE_STEPS consecutive steps (1);
#            TRACE_ARGS more of trace_gaps.py's options (--host, --chains N)
# variants:  benchmarks/train_throughput.py on $VARIANTS (each in its own process)
# perm:      benchmarks/permutation_kernels.py (the MoE permutation's gathers and sums, each way of writing them)
# ggemm:     benchmarks/grouped_gemm.py (Triton grouped GEMM vs torch._grouped_mm on the expert shapes)
# lora_kernels: benchmarks/lora_linear_kernels.py (a LoRA linear's op on the dense shapes, each way of adding LoRA)
# flash_train: full-size GLM-4.7-Flash through `moetune train` (random weights, packed demo data; overrides in
#              $FLASH_EXTRA);
#              flash_train_b, _c, _d: again with $FLASH_EXTRA_B and $FLASH_ENV_B (environment assignments), ...
# flash_80g:   the same with parallel.gpu_memory_gib 79.1 (layout auto; the allocator capped to 79.1 GiB); flash_72g
#              at 72 GiB, where auto recomputes the attention of some layers
# flash_varlen: flash_train with the packed documents through FlashAttention-2's varlen kernel
# variants2:   a second list ($VARIANTS2), results in $OUT/v2
# variants_old: $VARIANTS_OLD run by the harness of an earlier tree unpacked in .old/ (`rm -rf .old && mkdir .old &&
#              git archive REV | tar -x -C .old`, carried to the device: carry [".whl", ".old"]), results in $OUT/old:
#              the tree before a change against the tree after it, in one call
# air_train:   full-size GLM-4.5-Air through `moetune train` on one GPU: QUANT (fp8), AIR_TARGETS, AIR_AC, AIR_EXTRA
# air_auto:    the same with layout auto choosing the recompute; air_auto_b: again with LoRA targets $AIR_TARGETS_B
#              and overrides $AIR_EXTRA_B
# curves:      benchmarks/fp8_check.py curves $CURVES_ARGS (bf16 vs fp8 base loss curves)
# offload:     benchmarks/fp8_offload_check.py (an fp8 base with parallel.cpu_offload against without)
# mempeak:     benchmarks/memory_peak.py on $MEMPEAK_VARIANTS ($MEMPEAK_ARGS, default --layers 4): live at the peak
# fp8_numerics: benchmarks/fp8_check.py numerics_transformers (logits error: ours beside transformers' own FP8 paths)
# gpu_tests:   the CUDA twins of the CPU tests in $GPU_TESTS ($GPU_TESTS_K selects; default: varlen attention and the
#              rollback copy), run where their kernels exist
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/speed_session}
mkdir -p "$OUT" "$OUT/v2"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
# FlashAttention-4, where benchmarks/fa4_carry.sh installed it (model.attn_implementation varlen_fa4, the `_fa4` rows)
FA4_SITE=${FA4_SITE:-/tmp/fa4_site}
[ -d "$FA4_SITE/flash_attn" ] && export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
LOGS=$OUT/logs
mkdir -p "$LOGS"
# each stage's SM clock, power and temperature every 200 ms beside its log ($LOGS/<stage>.gpu.csv): step times that
# differ while the same kernels run are the clock's (BENCHMARKS.md, thirty-fourth session)
run() { local name=$1 limit=$2 smi=""; shift 2; local t0=$SECONDS
        if command -v nvidia-smi > /dev/null; then
          nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
            > "$LOGS/$name.gpu.csv" 2>&1 & smi=$!
        fi
        timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
        [ -n "$smi" ] && kill "$smi" 2> /dev/null
        { echo "== $name rc=$rc $((SECONDS - t0))s"; grep -E "layout \(auto\)|AIR_RESULT|Error|error:|^variant|^ours|^hf_|\"backend\"|^GPU span|best|^curves|OFFLOAD_CHECK|freed its cache|M=[0-9]|^    t|^numerics_transformers|^\{\"shape|^(flash|air)_[a-z_]+ +(bf16|fp8) " "$LOGS/$name.log" \
          | cut -c1-400 | tail -n 40; } | tee -a "$OUT/summary.txt"; }
PORT=29611
flash_train() {  # $1: name, rest: extra overrides
  # each run its own rendezvous port: a run stopped at its limit may still hold the last one while it exits
  local name=$1; shift; PORT=$((PORT + 1))
  run "$name" ${TRAIN_LIMIT:-200} env OUT="$OUT/$name" MASTER_PORT=$PORT MODEL=glm47-flash NPROC=1 SPEED_ONLY=1 \
    STEPS=${FLASH_STEPS:-12} \
    TARGETS="[mla_attention]" AC=none "$@" bash benchmarks/air_full_size.sh
}
for stage in ${STAGES:-attention trace variants}; do
  case $stage in
    attention) run attention ${ATTN_LIMIT:-120} python3 benchmarks/attention_kernels.py ;;
    trace) mkdir -p "$OUT/trace"
      run trace ${TRACE_LIMIT:-120} env BENCH_TRACE="$OUT/trace" BENCH_KERNELS=1 BENCH_PROFILE_STEPS=${TRACE_STEPS:-1} python3 benchmarks/train_throughput.py --timeout 110 \
        --variants ${TRACE_VARIANT:-ours_flash_mla_1x4096}
      grep KERNEL "$LOGS/trace.log" > "$OUT/trace_kernels.txt"
      for t in "$OUT"/trace/*.json; do python3 benchmarks/trace_gaps.py "$t" ${TRACE_CALLS:+--calls "$TRACE_CALLS"} \
        $TRACE_ARGS > "${t%.json}_gaps.txt" 2>&1; gzip -f "$t"; done ;;
    variants) run variants ${VARIANTS_LIMIT:-400} python3 benchmarks/train_throughput.py --timeout ${VARIANT_TIMEOUT:-80} --variants $VARIANTS ;;
    perm) run perm ${PERM_LIMIT:-120} python3 benchmarks/permutation_kernels.py ;;
    lora_kernels) run lora_kernels ${LK_LIMIT:-120} env OUT="$OUT" python3 benchmarks/lora_linear_kernels.py ;;
    ggemm) run ggemm ${GGEMM_LIMIT:-150} python3 benchmarks/grouped_gemm.py ${GGEMM_SHAPES:-flash air_ep8} ;;
    flash_train) flash_train flash_train EXTRA="${FLASH_EXTRA:-}" ;;
    flash_train_[b-d]) # the same run again: ${FLASH_EXTRA_B} overrides, ${FLASH_ENV_B} environment (B, C or D)
      x=${stage#flash_train_}; x=${x^^}; e=FLASH_EXTRA_$x; v=FLASH_ENV_$x
      flash_train "$stage" EXTRA="${!e:-}" ${!v:-} ;;
    flash_80g) flash_train flash_80g AC= LAYOUT_AUTO=1 EXTRA="--parallel.gpu_memory_gib 79.1" ;;
    flash_varlen) flash_train flash_varlen EXTRA="--model.attn_implementation varlen" ;;
    flash_72g) flash_train flash_72g AC= LAYOUT_AUTO=1 EXTRA="--parallel.gpu_memory_gib 72" ;;
    air_train) run air_train ${TRAIN_LIMIT:-200} env OUT="$OUT/air_train" QUANT=${QUANT:-fp8} NPROC=1 SPEED_ONLY=1 \
      STEPS=${AIR_STEPS:-12} TARGETS="${AIR_TARGETS:-[q_proj,k_proj,v_proj,o_proj]}" AC="${AIR_AC-attention}" \
      EXTRA="${AIR_EXTRA:-}" bash benchmarks/air_full_size.sh ;;
    air_auto|air_auto_b) t=AIR_TARGETS${stage#air_auto}; t=${t^^}  # air_auto_b: LoRA targets $AIR_TARGETS_B
      e=AIR_EXTRA${stage#air_auto}; e=${e^^}  # and overrides $AIR_EXTRA_B (else $AIR_EXTRA)
      run $stage ${TRAIN_LIMIT:-200} env OUT="$OUT/$stage" QUANT=${QUANT:-fp8} NPROC=1 SPEED_ONLY=1 \
      STEPS=${AIR_STEPS:-12} TARGETS="${!t:-[q_proj,k_proj,v_proj,o_proj]}" AC= LAYOUT_AUTO=1 \
      EXTRA="${!e:-${AIR_EXTRA:-}}" bash benchmarks/air_full_size.sh ;;
    curves) run curves ${CURVES_LIMIT:-200} env OUT="$OUT" python3 benchmarks/fp8_check.py curves ${CURVES_ARGS:-} ;;
    mempeak) for v in ${MEMPEAK_VARIANTS:-ours_fp8_air_experts_1x4096_packed_ac}; do
        run "mempeak_$v" ${MEMPEAK_LIMIT:-150} env OUT="$OUT" python3 benchmarks/memory_peak.py $v \
          ${MEMPEAK_ARGS:---layers 4}
      done ;;
    fp8_numerics) run fp8_numerics ${FP8_NUMERICS_LIMIT:-300} env OUT="$OUT" python3 benchmarks/fp8_check.py \
      numerics_transformers ;;
    offload) run offload ${OFFLOAD_LIMIT:-90} env OUT="$OUT" python3 benchmarks/fp8_offload_check.py ;;
    gpu_tests) run gpu_tests ${GPU_TESTS_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider \
      ${GPU_TESTS:-tests/unit/test_fast_paths.py tests/unit/test_reliability.py} -k "${GPU_TESTS_K:-varlen or rollback_copy}"
      tail -n 5 "$LOGS/gpu_tests.log" | tee -a "$OUT/summary.txt" ;;
    variants2) run variants2 ${VARIANTS_LIMIT:-400} python3 benchmarks/train_throughput.py --timeout ${VARIANT_TIMEOUT:-80} \
      --variants $VARIANTS2 --out "$OUT/v2" ;;
    variants_old) mkdir -p "$OUT/old"  # $VARIANTS_OLD from an earlier tree in .old/ (its harness imports its own src/)
      run variants_old ${VARIANTS_LIMIT:-400} python3 .old/benchmarks/train_throughput.py \
        --timeout ${VARIANT_TIMEOUT:-80} --variants $VARIANTS_OLD --out "$OUT/old" ;;
  esac
done
