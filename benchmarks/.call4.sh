python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
timeout 420 python3 -m pytest -q -x tests/test_decode.py -k "every_family or triton_kernels_match" -p no:cacheprovider 2>&1 | tail -15
