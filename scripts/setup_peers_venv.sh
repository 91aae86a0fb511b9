#!/usr/bin/env bash
# Create (or refresh) .venv-peers: fsdp2nb and the notebook tools benchmarks/peers.py compares it
# with, on the same torch as .venv. Safe to run twice. Each peer is installed on its own, so one
# that cannot be installed here (platform, Python or torch mismatch) leaves the others usable;
# the reason is kept in $venv/peers-install.log and the benchmark reports that peer as failed.
set -uo pipefail
venv=${1:-.venv-peers}
bash scripts/setup_venv.sh "$venv" || exit 1
py="$venv/bin/python"
log="$venv/peers-install.log"
: > "$log"
for package in ipyparallel jupyter-distributed nbdistributed accelerate torchmonarch; do
  if "$py" -m pip install -q --disable-pip-version-check "$package" >>"$log" 2>&1; then
    echo "installed $package" | tee -a "$log"
  else
    echo "FAILED to install $package (see $log)" | tee -a "$log"
  fi
done
# Installing a peer must not have replaced the torch both environments share.
"$py" -c "import torch; print('torch', torch.__version__)" | tee -a "$log"
