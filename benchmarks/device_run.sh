#!/usr/bin/env bash
# One run of the GPU benchmarks (see benchmarks/RESULTS.md). Run from a checkout
# on the GPU machine with the wheels of benchmarks/GPU_SETUP.md in .whl/:
#   bash benchmarks/device_run.sh MODE OUT_DIR     (MODE: one of the names below)
# largest: the largest actors step 3 trains on one GPU, LoRA and (left out with LARGEST_FULL=0 on
#   80 GB cards) full fine-tuning: LLaMA-7B with a TinyLlama critic (30% of the optimizer on the
#   host), then OPT-13B with an OPT-350m critic (55% of it and the reference's weights there)
# largestbf16: full fine-tuning of LLaMA-7B (TinyLlama critic) and OPT-13B (OPT-350m critic, the
#   reference's weights on the host) with bf16 optimizer state on the GPU, no optimizer offload
# presets: every one-GPU preset through steps 1-3, 5 steps each, smallest first (presets_run.py);
#   PRESETS="a b" runs those, in that order; PRESET_STEPS=N steps each (default 5); PRESET_TIMEOUT
#   seconds per preset (900); PRESET_REUSE=1 keeps the steps a call on the same (warm) machine
#   completed, so a 7B preset runs steps 1-2 in one call and step 3 in the next
# check: the CUDA tests (kernels against their references, graph replay against HF, refill,
#   phase peaks), then generation at bloom-560m and bloom-7b1 B16: HF, HF static cache, ours
# step3modes: step 3 at bloom-560m in every one-GPU mode (hybrid off, ours fast, checkpointed,
#   ZeRO-2, ZeRO-0)
# step3big: a bloom-7b1 actor with a bloom-560m critic, 8 x (256 + 256): full fine-tuning with the
#   optimizer states 60% on the host, LoRA, and hybrid off (offloaded) for 3 steps
# step3offload: bloom-560m with the replica as views of the shards and copied, then bloom-7b1 full
#   fine-tuning, both trained models checkpointed, at offload ratios $OFFLOAD_RATIOS (default
#   0.25 0.15; the first also with pageable host buffers and hybrid off, the others also with the
#   reference's weights on the host)
# big7b: bloom-7b1 with a bloom-560m critic, 8 x (256 + 256), 20 steps: full fine-tuning, both
#   trained models checkpointed, $OFFLOAD_RATIO (0.25) of the optimizer on the host (pinned); LoRA
#   checkpointed (left out with BIG7B_LORA=0); hybrid off (3 steps)
# big7blow: the same full fine-tuning at 0.15 with the reference's weights on the host
# step3offload1: the replica A/B, then bloom-7b1 at one ratio ($OFFLOAD_RATIO, 0.25) beside hybrid off
# rate: the bf16 matmul rate at step 3's training shapes (bloom-560m, bloom-1b7) and the step's limit
# adam: bloom-560m step 3 with torch's fused AdamW (the default) against its multi-tensor one, in both orders
# bf16opt: bloom-560m step 3 with bf16 optimizer state (--optimizer_dtype bf16), plain,
#   checkpointed and checkpointed in 2 training micro-batches, beside ours fast and hybrid off
# limit: bloom-560m step 3 with bf16 optimizer state, scored in the training forwards or not,
#   checkpointed (every block, every other block) or not, the phase timer synchronizing, beside hybrid off
# profile: bloom-560m step 3 with bf16 optimizer state, checkpointed and scored in training
#   (or $PROFILE_MODE), step 4 profiled: per phase, wall time against the time of the kernels it
#   launched (trace_phases.py); AND_PROFILE=1 runs it after limit
# zero2: tests/test_phases.py's CUDA tests, then bloom-560m step 3 (bf16 optimizer state, scored
#   in training, checkpointed) with actor and critic at ZeRO-2 against ZeRO-3, and ZeRO-2 with
#   every other block checkpointed, and ZeRO-3 with the allocator's cache emptied before training
# compileblocks: the allocator counters' CUDA test, then bloom-560m's blocks' training forward and
#   backward, eager against compiled (compile_blocks.py)
# compile: compile_blocks.py, then bloom-560m step 3 at ZeRO-2 (bf16 optimizer state, checkpointed, scored in training) with
#   --compile_blocks against eager, and half checkpointed compiled
# load: loading saved weights for a bf16 engine in fp32 first against in bf16 (load_weights.py), at
#   $LOAD_MODEL (llama-7b): a causal LM at ZeRO-2 and at ZeRO-3 offloaded, and a reward model;
#   LOAD_CASES="lm-zero2" runs one of them (at 7B the three take more than one 10-minute call;
#   a warm machine keeps the written folders for the next call)
# alloc: the CUDA tests of tests/test_phases.py, then bloom-560m step 3 (bf16 optimizer state,
#   checkpointed, scored in training) with the caching allocator's expandable segments and without
# big7bbf16: bloom-7b1 with a bloom-560m critic, 8 x (256 + 256), 20 steps, full fine-tuning with
#   bf16 optimizer state on the GPU (no host offload), checkpointed, beside hybrid off (3 steps);
#   on a GPU under 100 GB with the reference's weights on the host
# optim: the fused bf16 AdamW kernel's CUDA test
# logprobs: the fused log-probs' peak memory and time against plain logits at bloom-560m's and
#   bloom-7b1's output layers (logprob_memory.py)
# small16: bloom-560m step 3 within 16 GiB (optimizer states on the host, or a LoRA actor) beside ours fast
# attn: bloom-560m step 3 with Bloom's fused attention (the default) against HF's eager one, ours
#   fast, scored in the training forwards and checkpointed, beside hybrid off
# 1b7: step 3 with a bloom-1b7 actor and a bloom-560m critic: ours fast, checkpointed, hybrid off
# shards: bloom-560m step 3 with the actor's replica as views of its shards against a copied one
# step3fam: step 3 (fast path, 3 steps) with a GPT-NeoX, a LLaMA (grouped-query) and a GPT-2
#   actor and critic, each at ZeRO-3 on one GPU
# decode: the attention and linear kernel sweeps, then the off-by-default candidates end to end
# profile7b: where the bloom-7b1 step goes over the whole run (graph-replay profile of all 256
#   steps), then the attention sweep at that model's shape and mean key count
# start: the fast path's first call in cold, warm and race-only processes (fast_start.py)
# trl: a GRPO step of ours against TRL's GRPOTrainer (grpo_vs_trl.py); needs MODEL=a causal-LM
#   folder and the wheels of benchmarks/trl_wheels.sh in .whl-trl/ (or $TRL_WHEELS)
set -uo pipefail
what=${1:-gen}; out=${2:-/tmp/bench_out}; mkdir -p "$out"
# everything printed also goes to OUT/MODE.log: a call stopped at its time limit still returns
# what ran before the stop (a pipe into tail would lose it)
# (device_queue.sh writes that file itself and sets DEVICE_RUN_TEE=0)
[ "${DEVICE_RUN_TEE:-1}" = 1 ] && exec > >(tee -a "$out/$what.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi -L
# bloom-560m step 3 with the actor's replica as views of its shards against a copied one
shards_ab() {
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --modes "ours fast" \
    "ours fast, replica copied" --out "$out/step3_shards.md" 2>&1 | grep --line-buffered -v -i warn
}
if [ "$what" = gen ]; then
  python3 benchmarks/generation.py --models bloom-560m --batch 16 --layered --out "$out/gen" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/generation.py --models bloom-560m --batch 1 64 --modes hf unwrap generic fast --out "$out/gen" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/generation.py --models bloom-7b1 --batch 1 16 64 --repeats 3 --hf_busy --out "$out/gen" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/generation.py --models bloom-1b7 opt-1.3b llama-7b --batch 16 --modes hf unwrap generic fast --out "$out/gen" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = check ]; then
  # the per-candidate kernel reference check compiles every launch candidate: minutes
  python3 -m pytest -v -p no:cacheprovider --timeout 240 tests/test_decode.py tests/test_hybrid.py \
    tests/test_phases.py -k "cuda or triton" 2>&1 | grep --line-buffered -E "PASSED|FAILED|SKIPPED|ERROR|Timeout|passed|failed"
  python3 benchmarks/generation.py --models bloom-560m bloom-7b1 --batch 16 --modes hf hf_static fast \
    --out "$out/gen" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = step3modes ]; then
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --modes "ours fast" \
    "ours fast, checkpointed" "ours fast, ZeRO-2" "ours fast, ZeRO-0" "hybrid off" \
    --out "$out/step3_modes.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = step3big ]; then
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 20 --warmup 3 \
    --hybrid_off_steps 3 --offload_ratio 0.6 --modes "ours fast, optimizer offloaded" "ours fast, LoRA" \
    "hybrid off, optimizer offloaded" --out "$out/step3_7b1.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = step3offload ]; then
  # the replica as views of the shards against a copied one (bloom-560m, one rank), then full
  # fine-tuning at bloom-7b1 with both trained models checkpointed and more of the optimizer on the
  # GPU (OFFLOAD_RATIOS, host share of the optimizer states), 12 steps each; the first ratio
  # also with pageable host buffers and hybrid off, the others pinned only
  shards_ab
  first=1
  for r in ${OFFLOAD_RATIOS:-0.25 0.15}; do
    modes=("ours fast, optimizer offloaded, checkpointed, pinned")
    [ $first = 1 ] && modes+=("ours fast, optimizer offloaded, checkpointed" "hybrid off, optimizer offloaded, checkpointed")
    [ $first = 0 ] && modes+=("ours fast, optimizer offloaded, checkpointed, pinned, reference offloaded")
    first=0
    python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 12 --warmup 3 \
      --hybrid_off_steps 3 --offload_ratio $r --modes "${modes[@]}" \
      --out "$out/step3_offload.md" 2>&1 | grep --line-buffered -v -i warn
  done
elif [ "$what" = big7b ]; then
  modes=("ours fast, optimizer offloaded, checkpointed, pinned" "ours fast, LoRA, checkpointed"
         "hybrid off, optimizer offloaded, checkpointed")
  [ "${BIG7B_LORA:-1}" = 0 ] && modes=("${modes[0]}" "${modes[2]}")
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 20 --warmup 3 \
    --hybrid_off_steps 3 --offload_ratio ${OFFLOAD_RATIO:-0.25} --modes "${modes[@]}" \
    --out "$out/step3_7b1.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = big7blow ]; then
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 20 --warmup 3 \
    --offload_ratio 0.15 --modes "ours fast, optimizer offloaded, checkpointed, pinned, reference offloaded" \
    --out "$out/step3_7b1.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = step3offload1 ]; then
  # the short form for a short lease: the replica A/B, then bloom-7b1 at OFFLOAD_RATIO (0.25),
  # checkpointed and pinned, beside hybrid off
  shards_ab
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 10 --warmup 3 \
    --hybrid_off_steps 3 --offload_ratio ${OFFLOAD_RATIO:-0.25} --modes "ours fast, optimizer offloaded, checkpointed, pinned" \
    "hybrid off, optimizer offloaded, checkpointed" --out "$out/step3_offload.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = rate ]; then
  # the bf16 matmul rate at step 3's training shapes and the step's limit from it (H200: 4.8 TB/s)
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  bw=3.35e12; [ "$mem" -gt 100000 ] && bw=4.8e12
  python3 benchmarks/matmul_rate.py --bandwidth $bw --out "$out/matmul_rate_560m.md"
  python3 benchmarks/matmul_rate.py --bandwidth $bw --hidden 2048 --out "$out/matmul_rate_1b7.md"
elif [ "$what" = adam ]; then
  # both orders in one call (A B, then B A): a whole step's speed drifts between a process's first and later modes
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --modes "ours fast, foreach Adam" "ours fast" \
    --out "$out/step3_adam.md" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --modes "ours fast" "ours fast, foreach Adam" \
    --out "$out/step3_adam.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = bf16opt ]; then
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --hybrid_off_steps 3 \
    --modes "ours fast" "ours fast, bf16 optimizer" "ours fast, bf16 optimizer, checkpointed" \
    "ours fast, bf16 optimizer, checkpointed, 2 micro-batches" \
    "hybrid off, bf16 optimizer, checkpointed" --out "$out/step3_bf16opt.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = optim ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_optim.py -k cuda 2>&1 | tail -3
elif [ "$what" = logprobs ]; then
  # the fused log-probs against plain logits at step 3's micro-batch, bloom-560m's and bloom-7b1's heads
  python3 benchmarks/logprob_memory.py --batch 16 --tokens 257 --vocab 250880 --hidden 1024 --device cuda --dtype bf16
  python3 benchmarks/logprob_memory.py --batch 8 --tokens 257 --vocab 250880 --hidden 4096 --device cuda --dtype bf16
  python3 benchmarks/logprob_memory.py --batch 16 --tokens 257 --vocab 250880 --hidden 1024 --device cuda --dtype bf16 --scoring
elif [ "$what" = limit ]; then
  # bloom-560m step 3's fastest modes within and beside 16 GiB: bf16 optimizer state, with and
  # without the actor's and critic's scoring passes, beside hybrid off
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --hybrid_off_steps 3 \
    --modes "ours fast, bf16 optimizer" "ours fast, bf16 optimizer, checkpointed, scored in training" "ours fast, bf16 optimizer, checkpointed" \
    "ours fast, bf16 optimizer, half checkpointed" "ours fast, bf16 optimizer, half checkpointed, scored in training" \
    "ours fast, bf16 optimizer, checkpointed, phases synchronized" \
    "hybrid off, bf16 optimizer, checkpointed" --out "$out/step3_limit.md" 2>&1 | grep --line-buffered -v -i warn
  [ -n "${AND_PROFILE:-}" ] && bash "$0" profile "$out"
elif [ "$what" = profile ]; then
  # where bloom-560m's bf16 step goes: step 4 profiled, wall against kernel time per phase
  python3 benchmarks/step3.py --preset bloom-560m --steps 4 --warmup 2 --profile_step 4 \
    --modes "${PROFILE_MODE:-ours fast, bf16 optimizer, checkpointed, scored in training}" \
    --out "$out/step3_profile.md" 2>&1 | grep --line-buffered -v -i warn
  cat "$out"/step3_phases_*.md
elif [ "$what" = zero2 ]; then
  # bloom-560m's fastest modes within and beside 16 GiB with actor and critic at ZeRO-2 against
  # ZeRO-3, after the CUDA tests of the phase timer and allocator counters
  python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_phases.py 2>&1 | tail -25
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 \
    --modes "ours fast, bf16 optimizer, checkpointed, scored in training" \
    "ours fast, bf16 optimizer, checkpointed, scored in training, ZeRO-2" \
    "ours fast, bf16 optimizer, half checkpointed, scored in training, ZeRO-2" \
    "ours fast, bf16 optimizer, checkpointed, scored in training, cache emptied before training" \
    --out "$out/step3_zero2.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = compileblocks ]; then
  # the allocator counters' CUDA test, then bloom-560m's blocks alone, eager against compiled
  python3 -m pytest -q -p no:cacheprovider tests/test_phases.py -k allocator 2>&1 | tail -4
  python3 benchmarks/compile_blocks.py --out "$out/compile_blocks.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = compile ]; then
  python3 benchmarks/compile_blocks.py --out "$out/compile_blocks.md" 2>&1 | grep --line-buffered -v -i warn
  # bloom-560m's fastest mode within 16 GiB (ZeRO-2, checkpointed) with the trained models' blocks
  # compiled for training against eager, then half checkpointed compiled; 3 warm-up steps (compiling)
  python3 benchmarks/step3.py --preset bloom-560m --steps 6 --warmup 3 \
    --modes "ours fast, bf16 optimizer, checkpointed, scored in training, ZeRO-2" \
    "ours fast, bf16 optimizer, checkpointed, scored in training, ZeRO-2, compiled" \
    "ours fast, bf16 optimizer, half checkpointed, scored in training, ZeRO-2, compiled" \
    --out "$out/step3_compile.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = load ]; then
  # loading bf16 files for a bf16 engine in fp32 first against in bf16, at 7B (host memory: ~60 GB)
  python3 benchmarks/load_weights.py --model ${LOAD_MODEL:-llama-7b} ${LOAD_CASES:+--cases $LOAD_CASES} 2>&1 \
    | grep --line-buffered -v -i warn
elif [ "$what" = alloc ]; then
  # the phase timer's and allocator counters' CUDA tests, then bloom-560m's fastest mode within
  # 16 GiB with the caching allocator's expandable segments against its default segments
  python3 -m pytest -q -p no:cacheprovider tests/test_phases.py 2>&1 | tail -3
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 \
    --modes "ours fast, bf16 optimizer, checkpointed, scored in training" \
    "ours fast, bf16 optimizer, checkpointed, scored in training, expandable segments" \
    --out "$out/step3_alloc.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = big7bbf16 ]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  modes=("ours fast, bf16 optimizer, checkpointed, reference offloaded"
         "hybrid off, bf16 optimizer, checkpointed, reference offloaded")
  [ "$mem" -gt 100000 ] && modes=("ours fast, bf16 optimizer, checkpointed" "hybrid off, bf16 optimizer, checkpointed")
  python3 benchmarks/step3.py --preset bloom-7b1 --critic_preset bloom-560m --batch 8 --steps 20 --warmup 3 \
    --hybrid_off_steps 3 --modes "${modes[@]}" \
    --out "$out/step3_7b1_bf16.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = small16 ]; then
  # bloom-560m step 3 at table 3's shapes within 16 GiB: all of both optimizers on the host
  # (DeepSpeedCPUAdam), or a LoRA actor; both checkpointed; beside ours fast and hybrid off
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --hybrid_off_steps 3 --offload_ratio 1.0 \
    --modes "ours fast" "ours fast, optimizer offloaded, checkpointed, pinned" "ours fast, LoRA, checkpointed" \
    "hybrid off" --out "$out/step3_small16.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = attn ]; then
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --hybrid_off_steps 3 --modes "ours fast" \
    "ours fast, eager attention" "ours fast, scored in training" "ours fast, checkpointed" "hybrid off" \
    --out "$out/step3_attn.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = 1b7 ]; then
  python3 benchmarks/step3.py --preset bloom-1b7 --critic_preset bloom-560m --steps 5 --warmup 2 --hybrid_off_steps 3 \
    --modes "ours fast" "ours fast, checkpointed" "hybrid off" --out "$out/step3_1b7.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = shards ]; then
  shards_ab
elif [ "$what" = largest ]; then
  # LoRA rows first, checkpointed (without, both ran out of an 80 GB card); LARGEST_FULL=0 leaves out full fine-tuning (an H200):
  # LLaMA-7B, and OPT-13B, whose 16 bytes/param of training state (206 GB) plus its reference fit
  # only split between the GPU (weights, gradients, 45% of the optimizer) and the host (55% of the
  # optimizer, 85 GB; the reference's weights, 26 GB)
  # LLaMA-7B first (its LoRA row, then full fine-tuning with 30% of the optimizer on the host), then OPT-13B
  python3 benchmarks/step3.py --preset llama-7b --critic_preset tinyllama-1.1b --batch 8 --steps 10 --warmup 3 \
    --modes "ours fast, LoRA, checkpointed" --out "$out/step3_largest.md" 2>&1 | grep --line-buffered -v -i warn
  if [ "${LARGEST_FULL:-1}" = 1 ]; then
    python3 benchmarks/step3.py --preset llama-7b --critic_preset tinyllama-1.1b --batch 8 --steps 10 --warmup 3 \
      --offload_ratio 0.3 --modes "ours fast, optimizer offloaded, checkpointed, pinned" \
      --out "$out/step3_largest.md" 2>&1 | grep --line-buffered -v -i warn
  fi
  python3 benchmarks/step3.py --preset opt-13b --critic_preset opt-350m --batch 8 --steps 6 --warmup 2 \
    --modes "ours fast, LoRA, checkpointed" --out "$out/step3_largest.md" 2>&1 | grep --line-buffered -v -i warn
  if [ "${LARGEST_FULL:-1}" = 1 ]; then
    python3 benchmarks/step3.py --preset opt-13b --critic_preset opt-350m --batch 8 --steps 6 --warmup 2 \
      --offload_ratio 0.55 --modes "ours fast, optimizer offloaded, checkpointed, reference offloaded" \
      --out "$out/step3_largest.md" 2>&1 | grep --line-buffered -v -i warn
  fi
elif [ "$what" = largestbf16 ]; then
  # full fine-tuning with bf16 optimizer state on the GPU (8 bytes/param; the one-rank replica is
  # views of the shards): LLaMA-7B + TinyLlama (54 GB of actor state), OPT-13B + OPT-350m with the
  # reference's weights on the host (104 GB of actor state); LARGEST_BF16="opt-13b" runs one
  for actor in ${LARGEST_BF16:-llama-7b opt-13b}; do
    if [ "$actor" = llama-7b ]; then
      python3 benchmarks/step3.py --preset llama-7b --critic_preset tinyllama-1.1b --batch 8 --steps 10 --warmup 3 \
        --modes "ours fast, bf16 optimizer, checkpointed" --out "$out/step3_largest_bf16.md" 2>&1 | grep --line-buffered -v -i warn
    else
      python3 benchmarks/step3.py --preset opt-13b --critic_preset opt-350m --batch 8 --steps 6 --warmup 2 \
        --modes "ours fast, bf16 optimizer, checkpointed, reference offloaded" \
        --out "$out/step3_largest_bf16.md" 2>&1 | grep --line-buffered -v -i warn
    fi
  done
elif [ "$what" = presets ]; then
  python3 benchmarks/presets_run.py --deployment-type single_gpu --steps ${PRESET_STEPS:-5} --timeout ${PRESET_TIMEOUT:-900} \
    ${PRESETS:+--presets $PRESETS} ${PRESET_REUSE:+--reuse} \
    --workdir "${PRESETS_WORKDIR:-/tmp/dschat_presets}" --out "$out/presets.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = decode ]; then
  python3 benchmarks/attn_bench.py --out "$out" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/linear_bench.py --out "$out" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/linear_bench.py --tma --shapes "7b1 qkv" "7b1 dense" "7b1 fc1+gelu" "7b1 fc2" "7b1 head" \
    --out "$out" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/decode_bench.py --plan candidates --profile bloom-560m --out "$out" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = profile7b ]; then
  python3 benchmarks/decode_bench.py --plan bloom-7b1:bf16:16 --numerics fast --profile bloom-7b1 \
    --profile-steps 256 --out "$out" 2>&1 | grep --line-buffered -v -i warn
  python3 benchmarks/attn_bench.py --shapes "bloom-7b1 B16" --pos 384 --out "$out" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = start ]; then
  python3 benchmarks/fast_start.py --model bloom-560m --batch 16 --out "$out/fast_start.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = trl ]; then
  : "${MODEL:?set MODEL to a causal-LM folder (SmolLM2-135M-Instruct)}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/trl/site-packages ${TRL_WHEELS:-.whl-trl}/*.whl || exit 1
  PYTHONPATH=$PYTHONPATH:/tmp/trl/site-packages python3 benchmarks/grpo_vs_trl.py --model "$MODEL" \
    --out "$out/grpo_vs_trl.md" 2>&1 | grep --line-buffered -v -i warn
elif [ "$what" = step3fam ]; then
  for preset in pythia-1.4b tinyllama-1.1b gpt2-xl; do
    python3 benchmarks/step3.py --preset $preset --modes "ours fast" --steps 3 --warmup 1 \
      --out "$out/step3_families.md" 2>&1 | grep --line-buffered -v -i warn | tail -4
  done
else
  python3 benchmarks/step3.py --preset bloom-560m --steps 5 --warmup 2 --profile_step 4 --out "$out/step3.md" 2>&1 | grep --line-buffered -v -i warn
fi
