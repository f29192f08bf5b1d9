#!/usr/bin/env bash
# The FP8 base's measurements on ONE H200, in priority order, each bounded, results under $OUT after each:
# full-size GLM-4.5-Air through `moetune train` (LoRA q,k,v,o; then + shared and routed experts), the 200-step loss
# curves and the logits error, then GLM-4.7-Flash fp8 vs bf16 through the harness.
#   bash benchmarks/fp8_session.sh            (on the GPU machine; pydantic wheels in .whl when it lacks them)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fp8_session}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
LOGS=/tmp/fp8_session_logs
mkdir -p "$LOGS"
run() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
        { echo "== $name rc=$?"; grep -E "AIR_RESULT|Error|error:|^variant|^ours|final_ratio|^numerics" "$LOGS/$name.log" \
          | cut -c1-700 | tail -n 6; } | tee -a "$OUT/summary.txt"; }
run air_qkvo 150 env OUT="$OUT/air_qkvo" QUANT=fp8 NPROC=1 AC=attention SPEED_ONLY=1 STEPS=12 bash benchmarks/air_full_size.sh
run air_experts 150 env OUT="$OUT/air_experts" QUANT=fp8 NPROC=1 AC=full SPEED_ONLY=1 STEPS=12 \
  TARGETS="[q_proj,k_proj,v_proj,o_proj,shared_experts,experts]" bash benchmarks/air_full_size.sh
run check 260 python3 benchmarks/fp8_check.py curves numerics --task markov --bases bf16,fp8_dequant_bf16,fp8
run flash 115 python3 benchmarks/train_throughput.py --timeout 55 --variants ours_fp8_flash_mla_1x4096 ours_flash_mla_1x4096
