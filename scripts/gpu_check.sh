#!/usr/bin/env bash
# GPU checks for a machine with CUDA: the GPU-marked tests (NCCL pool, device assignment, direct
# reads of a cold checkpoint onto GPUs, async save with pinned staging and resume, the
# engine in bf16 and with offloaded parameters), then the pool benchmark. Prints what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup_venv.sh .venv
nvidia-smi -L
.venv/bin/python -m pytest -q -m gpu tests/gpu
.venv/bin/python benchmarks/bench_pool.py --runs 50 --starts 2
