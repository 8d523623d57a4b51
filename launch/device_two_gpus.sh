#!/bin/bash
# The 2xH200 run of docs/benchmarks.md (device tool, kind nvidia-h200-x2; extra overrides apply to
# every run): stage=bench on GPU 0,
# then stage=extract on the Qwen3.6-27B shape (random weights, random-token ShareGPT-like data)
# with 1 process on GPU 0 and with 2 processes, each timed by the stage itself. Untimed runs on the
# same data first (2 processes, then 1 on GPU 0) fill the Triton, Inductor and fla autotune caches
# on the machine's disk for every batch shape each timed run will meet on each GPU, so that the
# timed runs compare steady states (a batch shape met for the first time costs ~0.8 s more;
# docs/benchmarks.md).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline
nvidia-smi --query-gpu=index,name,memory.total --format=csv
COMMON=(model=qwen3_6_27b model.init=random 'extract.layer_ids=[1,16,31,46,61]' extract.token_budget=12000
        data=random_tokens data.num_samples=${NUM_SAMPLES:-900} output_root=/tmp/out "$@")
if [ "${BENCH:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 dflash/main.py stage=bench bench=h200 "${COMMON[@]}" run_name=bench \
    wandb.mode=disabled 2>&1 | grep -v "Loading weights\|falling back" | tee $OUT/bench.log | grep -A9 "bench results"
fi
python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 --main_process_port 29600 dflash/main.py \
  stage=extract "${COMMON[@]}" run_name=warm2 2>&1 | grep "throughput\|Error" || true
CUDA_VISIBLE_DEVICES=0 python3 dflash/main.py stage=extract "${COMMON[@]}" run_name=warm1 2>&1 \
  | grep "throughput\|Error" || true
rm -rf /tmp/out/warm2 /tmp/out/warm1
CUDA_VISIBLE_DEVICES=0 python3 dflash/main.py stage=extract "${COMMON[@]}" run_name=one_gpu 2>&1 \
  | grep -v "Loading weights\|falling back\|it/s\]" | tee $OUT/one_gpu.log | grep "throughput\|complete\|Error" || true
rm -rf /tmp/out/one_gpu/states
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "one GPU: no 2-process run"; exit 0; }
python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 --main_process_port 29600 dflash/main.py \
  stage=extract "${COMMON[@]}" run_name=two_gpus 2>&1 | grep -v "Loading weights\|falling back\|it/s\]" \
  | tee $OUT/two_gpus.log | grep "throughput\|complete\|barrier\|Error" || true
cp /tmp/out/two_gpus/wandb/offline-run-*/run-*.wandb $OUT/two_gpus.wandb 2>/dev/null || true
cp /tmp/out/two_gpus/progress/*.json $OUT/ 2>/dev/null || true
