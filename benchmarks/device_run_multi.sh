#!/usr/bin/env bash
# Multi-GPU benchmark runs (results in benchmarks/RESULTS.md). Run from a checkout on a
# machine of N GPUs with the wheels of benchmarks/GPU_SETUP.md in .whl/:
#   NGPU=2 bash benchmarks/device_run_multi.sh correctness|speed OUT_DIR
#  correctness: per-rank logits vs HF (bloom-560m fp32+bf16, bloom-1b7 bf16), then 50 PPO steps
#               of bloom-560m actor + critic at ZeRO-3 with the hybrid engine, every rank on its
#               own prompts
#  speed:       50 PPO steps of bloom-1b7 (8 x (256 + 128) per GPU), generation.py at world
#               size N (full and layered), step-3 modes hybrid off / ours generic
#  big7b:       a bloom-7b1 actor with a bloom-560m critic, all at ZeRO-3, 16 x (256 + 256) per
#               GPU: ours fast (both trained models checkpointed) for $STEPS7B (30) steps beside
#               hybrid off (3 steps), then per-rank logits and greedy tokens at bloom-7b1 against
#               plain single-GPU HF (bf16, fp32)
set -uo pipefail
what=${1:-correctness}; out=${2:-/tmp/bench_out}; n=${NGPU:-2}; mkdir -p "$out"
exec > >(tee -a "$out/$what.log") 2>&1      # kept in OUT even when the call's limit stops the run
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0   # no NVLink multicast (KINDS.md)
nvidia-smi -L
launch() { python3 -m deepspeed.launcher.runner --num_gpus "$n" --master_port $((29500 + RANDOM % 1000)) "$@"; }
quiet() { grep -v -i -E "warn|^\[|info|deprecat" || true; }
if [ "$what" = correctness ]; then
  launch benchmarks/rank_check.py --model bloom-560m --dtypes fp32 bf16 --batch 8 --prompt_len 128 \
    --new_tokens 32 --out "$out/rank_check" 2>&1 | quiet
  launch benchmarks/rank_check.py --model bloom-1b7 --dtypes bf16 --batch 8 --prompt_len 128 \
    --new_tokens 32 --out "$out/rank_check" 2>&1 | quiet
  python3 benchmarks/step3.py --preset bloom-560m --modes "ours fast" --steps 50 --warmup 2 \
    --num_gpus "$n" --workdir /tmp/s3_560m --out "$out/step3.md" 2>&1 | quiet
  cp /tmp/s3_560m/ours_fast/metrics.jsonl "$out/ppo50_bloom560m_metrics.jsonl" 2>/dev/null
elif [ "$what" = big7b ]; then
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 16 --steps ${STEPS7B:-30} \
    --warmup 3 --hybrid_off_steps 3 --num_gpus "$n" --workdir /tmp/s3_7b1 \
    --modes "ours fast, checkpointed" "hybrid off, checkpointed" --out "$out/step3_7b1.md" 2>&1 | quiet
  for d in /tmp/s3_7b1/bloom-7b1+bloom-560m/*/; do cp "$d/metrics.jsonl" "$out/metrics_$(basename "$d").jsonl" 2>/dev/null; done
  launch benchmarks/rank_check.py --model bloom-7b1 --dtypes bf16 fp32 --batch 8 --prompt_len 128 \
    --new_tokens 32 --out "$out/rank_check_7b1" 2>&1 | quiet
else
  python3 benchmarks/step3.py --preset bloom-1b7 --modes "ours fast" --steps 50 --warmup 2 --batch 8 \
    --answer_len 128 --num_gpus "$n" --workdir /tmp/s3_1b7 --out "$out/step3.md" 2>&1 | quiet
  cp /tmp/s3_1b7/ours_fast/metrics.jsonl "$out/ppo50_bloom1b7_metrics.jsonl" 2>/dev/null
  launch benchmarks/generation.py --models bloom-560m --batch 16 --layered --out "$out/gen" 2>&1 | quiet
  python3 benchmarks/step3.py --preset bloom-560m --modes "hybrid off" "ours generic" --steps 3 --warmup 1 \
    --num_gpus "$n" --workdir /tmp/s3_560m --out "$out/step3.md" 2>&1 | quiet
fi
