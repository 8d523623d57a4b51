#!/bin/bash
# What the H200 runs in docs/benchmarks.md came from (device tool): GPU tests, then the benchmark.
#   bash launch/device_bench.sh [extra overrides for stage=bench]      (TESTS=0 skips the tests)
set -euo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15
fi
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 dflash/main.py stage=bench bench=h200 model=qwen3_6_27b \
  model.init=random 'extract.layer_ids=[1,16,31,46,61]' extract.token_budget=12000 wandb.mode=disabled \
  output_root=/tmp/out run_name=bench "$@" 2>&1 | grep -v "Loading weights\|falling back" | tee $OUT/bench.log \
  | grep "bench:\|untimed\|: [0-9.]* s,\|results\|^|\|round trip\|first time\|loop:\|Error\|error"
