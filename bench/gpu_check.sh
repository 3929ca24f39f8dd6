#!/usr/bin/env bash
# The GPU check of issue 20, one script, under 10 minutes on an H100/H200-class GPU:
#   1. the kernel tests compiled on the device (tests/kernels, PAGEWARDEN_KERNEL_DEVICE=cuda),
#      including the engine's token-exact test against transformers and fault recovery;
#   2. the throughput bench on the default model, bf16, integrity off / standard / strict,
#      at 64 x 128/128 and 256 x 512/256;
#   3. overheads against off and the memory roofline (bench/gpu_roofline.py).
# Python packages the device image lacks travel as wheels in .whl/ (docs/gpu.md says
# which and how); logs go to $OUT (the device tool's folder) or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# A wheel larger than one call may carry (the default model's, 89 MiB) comes split
# (split -b 30M W W.part-) over earlier calls that copied the parts to /tmp/pw-parts.
mkdir -p /tmp/pw-whl
for first in /tmp/pw-parts/*.part-aa; do
    [ -e "$first" ] || continue
    wheel=${first%.part-aa}
    cat "$wheel".part-* >"/tmp/pw-whl/$(basename "$wheel")"
done
wheels=$(compgen -G ".whl/*.whl"; compgen -G "/tmp/pw-whl/*.whl")
if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $wheels || exit 1
    export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1

echo "== 1. kernel tests on the device (compiled), token-exact engine test"
PAGEWARDEN_KERNEL_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels 2>&1 | tee "$LOGS/kernel_tests.log"

echo "== 2. throughput, bf16, off / standard / strict (engine on cuda, triton backend)"
# The three engines run side by side on the one GPU: each gets a fixed KV budget.
timeout 150 python3 bench/throughput.py --no-hf --no-single --rounds 2 \
    --num-prompts 64 --input-len 128 --output-len 128 --kv-cache-memory 8GiB --log-dir /tmp/pw-bench-a \
    2>&1 | tee "$LOGS/throughput_64x128.log"
timeout 200 python3 bench/throughput.py --no-hf --no-single --rounds 1 \
    --num-prompts 256 --input-len 512 --output-len 256 --kv-cache-memory 16GiB --log-dir /tmp/pw-bench-b \
    2>&1 | tee "$LOGS/throughput_256x512.log"

echo "== 3. overheads and roofline"
timeout 60 python3 bench/gpu_roofline.py "$LOGS/throughput_64x128.log" \
    "$LOGS/throughput_256x512.log" 2>&1 | tee "$LOGS/roofline.log"
