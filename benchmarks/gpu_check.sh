#!/usr/bin/env bash
# The device check for a session lent one GPU (torch >= 2.11 with CUDA, no package registry), in one command:
#   bash benchmarks/gpu_check.sh            # ~4 min on one H200; logs + results under $OUT (else benchmarks/results/gpu)
# 1. installs autopar without its dependencies (highspy, if missing there, must come as a wheel on PYTHONPATH),
# 2. calibrates the device and compares predicted with measured compute (gpu_calibrate.py --executor: also autopar's
#    graph executor vs eager on world 1 over NCCL), writing bench_gpu_cluster.json and bench_gpu.md,
# 3. runs scripts/gpu_check_execute.py, the NCCL test (pytest -m gpu) and the main job (examples.train) on world 1.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi -L
python3 -c "import torch, highspy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
timeout 300 python3 benchmarks/gpu_calibrate.py --executor 2>&1 | tee "$out/calibrate.log"
cp benchmarks/results/bench_gpu_cluster.json benchmarks/results/bench_gpu.md "$out/" 2>/dev/null
timeout 120 python3 scripts/gpu_check_execute.py 2>&1 | tee "$out/execute.log"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_execute_dist.py 2>&1 | tee "$out/gpu_test.log"
timeout 120 torchrun --standalone --nproc-per-node 1 -m autopar.examples.train --model llama-tiny --mesh 1 --steps 5 \
  2>&1 | tee "$out/train.log"
