python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
S=$(date +%s); t(){ echo "[$(( $(date +%s) - S ))s] $*"; }
t tests
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_hybrid.py -k refill_on_cuda > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
t gen560
timeout 200 python3 benchmarks/generation.py --models bloom-560m --batch 16 --modes hf generic fast --dsfetch --out $OUT/gen560 > $OUT/gen560.log 2>&1; grep "^|" $OUT/gen560.log | tail -8
t step3
timeout 200 python3 benchmarks/step3.py --preset bloom-560m --modes "ours fast" --steps 6 --out $OUT/step3.md > $OUT/step3.log 2>&1; tail -8 $OUT/step3.md
t gen7b1
timeout 240 python3 benchmarks/generation.py --models bloom-7b1 --batch 16 --modes hf fast --out $OUT/gen7b1 > $OUT/gen7b1.log 2>&1; grep "^|" $OUT/gen7b1.log | tail -4
t done
