#!/usr/bin/env bash
# Full-size GLM-4.5-Air-shaped LoRA run (46 layers, 128 experts, vocab 151552, random bf16 weights materialised
# shard by shard on the GPUs), seq 4096 packed: 30 steps with checkpoints, a resume for 10 more, an adapter export.
#   NPROC=8 bash benchmarks/air_full_size.sh            (the 8 x H200 run of the issue)
#   NPROC=2 bash benchmarks/air_full_size.sh            (what fits on 2 GPUs: FSDP2 over both, full AC)
#   MODEL=tiny NPROC=2 DEVICE=cpu bash benchmarks/air_full_size.sh   (a CPU rehearsal of the same commands)
#   EP=2 AC=none SPEED_ONLY=1 STEPS=14 NPROC=2 bash benchmarks/air_full_size.sh   (throughput only: no resume/export)
#   LAYERS=8 NPROC=1 AC=none SPEED_ONLY=1 STEPS=14 bash benchmarks/air_full_size.sh   (AIR-8 through the CLI, 1 GPU)
#   MODEL=glm47-flash TARGETS=[mla_attention] NPROC=1 AC= LAYOUT_AUTO=1 EXTRA="--parallel.gpu_memory_gib 79.1" \
#     SPEED_ONLY=1 STEPS=12 bash benchmarks/air_full_size.sh   (GLM-4.7-Flash as on an 80 GB GPU, layout auto)
#   QUANT=fp8 NPROC=1 AC=attention SPEED_ONLY=1 STEPS=12 bash benchmarks/air_full_size.sh   (full Air, fp8 base, 1 GPU)
set -euo pipefail
NPROC=${NPROC:-8}
MODEL=${MODEL:-glm45-air}
OUTDIR=${OUT:-/tmp/air_full}
RUN=${RUN_DIR:-/tmp/air_runs}
TARGETS=${TARGETS:-[q_proj,k_proj,v_proj,o_proj]}
SEQ=${SEQ:-4096}
AC=${AC-full}  # empty: not set (layout auto chooses)
COMPILE=${COMPILE:-true}
EP=${EP:-1}
MICRO=${MICRO:-1}
LAYERS=${LAYERS:-}  # fewer decoder layers (e.g. 8: the AIR-8 proxy through the CLI on one GPU)
QUANT=${QUANT:-}  # fp8 | fp8_block: the frozen base stored in fp8 (model.quantize)
STEPS=${STEPS:-30}
LAYOUT=()
# EP and AC as given (layout manual: no memory-estimate veto), unless LAYOUT_AUTO is set
[ -n "${LAYOUT_AUTO:-}" ] || LAYOUT=(--parallel.layout manual --parallel.ep "$EP")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
common=(configs/glm45-air-lora.yaml --model.path null --model.config "$MODEL" --model.init_std 0.02
        --model.dtype bfloat16 --data.train null --data.eval null --data.seq_len "$SEQ" --lora.targets "$TARGETS"
        --train.micro_batch_size "$MICRO" --train.grad_accum 1 ${AC:+--train.activation_checkpointing "$AC"}
        --train.compile "$COMPILE" --eval.every 0 --eval.max_batches 2 --logging.expert_stats_every 10
        --logging.progress_bar false --checkpoint.every 15 --checkpoint.keep_last 2 --optim.warmup_steps 5
        --run.output_dir "$RUN" --run.name air "${LAYOUT[@]}" ${LAYERS:+--model.num_hidden_layers "$LAYERS"}
        ${QUANT:+--model.quantize "$QUANT"} ${EXTRA:-})
launch=(python3 -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29611}" -m moetune train)
rm -rf "$RUN"
t0=$(date +%s.%N)
mkdir -p "$OUTDIR"
"${launch[@]}" "${common[@]}" --train.steps "$STEPS" --resume none > "$OUTDIR/train.log" 2>&1 || {
  grep -E "Error|error:|OutOfMemory" "$OUTDIR/train.log" | grep -v "^\s*File" | head -n 8; exit 1; }
tail -n 8 "$OUTDIR/train.log"
t1=$(date +%s.%N)
if [ -n "${SPEED_ONLY:-}" ]; then
  mkdir -p "$OUTDIR"
  cp "$RUN/air/metrics.jsonl" "$OUTDIR/"
  cp "$RUN"/air/memory_snapshot/*.json "$OUTDIR/" 2>/dev/null || true  # logging.memory_snapshot_step's summary
  cp -r "$RUN/air/profile" "$OUTDIR/" 2>/dev/null || true  # logging.profile_step's trace and tables
  python3 - "$RUN/air/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "tokens_per_s_per_gpu" in r]
later = [r for r in steps if r["step"] > 4]  # past compile and warm-up
print("AIR_RESULT " + json.dumps({"steps": len(steps),
      "median_tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in later),
      "median_mfu": statistics.median(r.get("mfu") or 0 for r in later),
      "peak_mem_gib": max(r["mem_gib"] for r in steps), "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
      "peak_reserved_gib": max(r.get("mem_reserved_gib") or 0 for r in steps),
      "alloc_retries": steps[-1].get("alloc_retries"), "step_s": [round((b["tokens"] - a["tokens"]) / b["tokens_per_s"], 3) for a, b in zip(steps, steps[1:])]}))
PY
  exit 0
fi
"${launch[@]}" "${common[@]}" --train.steps 40 --resume auto 2>&1 | grep -Ei "resum|done|error" | tail -n 5
t2=$(date +%s.%N)
python3 -m moetune export adapter --checkpoint "$RUN/air" --out "$OUTDIR/peft_adapter" --format peft
t3=$(date +%s.%N)
mkdir -p "$OUTDIR"
cp "$RUN/air/metrics.jsonl" "$OUTDIR/air_metrics.jsonl"
du -sb "$RUN/air/checkpoints/"* "$OUTDIR/peft_adapter" | tee "$OUTDIR/sizes.txt"
python3 - "$RUN/air/metrics.jsonl" "$t0" "$t1" "$t2" "$t3" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "tokens_per_s_per_gpu" in r]
t0, t1, t2, t3 = map(float, sys.argv[2:6])
later = [r for r in steps if r["step"] > 5 and r["step"] not in (30, 31)]  # past compile / warm-up and the resume step
ck = [r for r in rows if "checkpoint_s" in r]
print(json.dumps({
    "steps": len(steps), "median_tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in later),
    "median_mfu": statistics.median(r.get("mfu") or 0 for r in later), "peak_mem_gib": max(r["mem_gib"] for r in steps),
    "checkpoints": ck, "first_run_s": round(t1 - t0, 1), "resume_run_s": round(t2 - t1, 1), "export_s": round(t3 - t2, 1),
    "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]]}, indent=1))
PY
