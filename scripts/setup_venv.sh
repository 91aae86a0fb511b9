#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment. Safe to run twice.
# torch first: without a GPU take the CPU build, so no multi-GB CUDA wheel is pulled in.
set -euo pipefail
venv=${1:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
if "$py" -c "import torch" 2>/dev/null; then
  :  # keep whatever torch the environment already has
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$py" -m pip install -q "torch>=2.7"
else
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e ".[test]"
