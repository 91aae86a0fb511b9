#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment. Safe to run twice.
#   bash scripts/setup_venv.sh [VENV] [EXTRA]   EXTRA: test (default; what `make test` needs) or
#   demo (the package and what scripts/run_demo.py needs, for `make demo`).
# torch first: with a GPU, the package index's build (CUDA, several GB of wheels); without one,
# the CPU-only build from PyTorch's CPU index (about 200 MB), or, where that index cannot be
# reached, from the package index (on most machines its CUDA build; this says so).
# FSDP2NB_TORCH_INDEX replaces the CPU index (a mirror, say).
set -euo pipefail
venv=${1:-.venv}
extra=${2:-test}
cpu_index=${FSDP2NB_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
probe_s=5
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip

index_answers() {  # whether the index lists torch within probe_s (timeout also bounds DNS)
  timeout "$probe_s" "$py" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))' \
    "${1%/}/torch/" "$probe_s" >/dev/null 2>&1
}

install_cpu_torch() {
  if index_answers "$cpu_index" \
     && "$py" -m pip install -q --index-url "$cpu_index" --timeout 30 --retries 1 "torch==2.13.0"; then
    return
  fi
  echo "setup_venv: $cpu_index did not answer; installing torch from the package index" \
       "(on most machines its CUDA build, several GB)" >&2
  "$py" -m pip install -q "torch==2.13.0"
}

if "$py" -c "import torch" 2>/dev/null; then
  :  # keep whatever torch the environment already has
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install -q "torch>=2.13"
else
  install_cpu_torch
fi
"$py" -m pip install -q -e ".[$extra]"
