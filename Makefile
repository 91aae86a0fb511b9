# make demo: run notebooks/quickstart.ipynb headless on CPU ranks (or GPUs when present), then
#            print what it showed; installs the package and the `demo` extra only. make lab: open
#            it in JupyterLab (as root too).
# make test: make lint (ruff, mypy on the kernel side: [tool.mypy] in pyproject.toml), then the
#            whole test suite (CPU, gloo; tests/browser in Debian's chromium, installed when
#            missing); installs the `test` extra, also after a `make demo`.
#            Both set up .venv themselves and may be run twice.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fsdp2nb-installed
DEMO_STAMP := $(VENV)/.fsdp2nb-demo-installed
# pytest-xdist workers for `make test`: most tests wait on kernels, ranks and sockets more than
# they compute, so two share a 2-core machine well; each worker takes one test file at a time.
TEST_WORKERS ?= 2

.PHONY: demo test lint bench bench-peers lab gpu-check clean soak

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV) test
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV) demo
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) scripts/run_demo.py notebooks/quickstart.ipynb

lint: $(STAMP)
	$(PY) -m ruff check fsdp2nb tests benchmarks scripts
	$(PY) -m mypy

test: $(STAMP) lint
	bash scripts/install_chromium.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# JupyterLab comes with the [test] extra; it refuses root (containers, CI) without --allow-root.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) notebooks/quickstart.ipynb

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) -m benchmarks.$$(basename $$b .py) || exit 1; done  # as modules: ranks import them by name

# bench-peers: fsdp2nb beside ipyparallel, jupyter-distributed, nbdistributed, accelerate and
# Monarch, installed in .venv-peers on the same torch; writes docs/peers.md.
PEERS_STAMP := .venv-peers/.peers-installed

$(PEERS_STAMP): pyproject.toml scripts/setup_venv.sh scripts/setup_peers_venv.sh
	bash scripts/setup_peers_venv.sh .venv-peers
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	.venv-peers/bin/python -m benchmarks.peers --markdown docs/peers.md

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache

# make soak: the tests marked soak, which the suite deselects: the variants it leaves out (Notebook 7
# beside JupyterLab, Ray pools across hosts that the suite covers on one host), the long fault campaign (200 seeded
# faults on 4 CPU ranks) and the long day (2,000 mixed cells on one 2-rank pool, with a table of
# the kernel's and ranks' memory, descriptors, threads and files, and whatever grew without bound)
# and the session model-checker (5 seeds of 8 random sessions of up to 100 actions, with counts).
# SOAK_ARGS="--soak-faults 30 --soak-seed 7" (also --soak-ranks, --soak-timeout, --soak-kinds;
# --long-day-cells, --long-day-ranks, --long-day-seed; --session-seed, --session-seeds,
# --session-actions, --session-examples, --session-shrink).
soak: $(STAMP)
	$(PY) -m pytest -m soak -s tests $(SOAK_ARGS)
