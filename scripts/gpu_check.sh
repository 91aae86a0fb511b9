#!/usr/bin/env bash
# GPU checks on a machine with CUDA: the GPU-marked tests (NCCL pool, device choice, direct reads
# onto GPUs, async save with pinned staging and resume, snapshots in host memory restored after a
# restart, bf16 and offloaded parameters), then
# benchmarks/bench_gpu.py, then notebooks/finetune_gpu.ipynb and sft_trainer.ipynb executed end to
# end. Everything is written to $OUT (default gpu-check-out/) and printed.
# Where .whl/ holds wheels (a lent GPU machine reaches no registry), the machine's own python3 and
# torch are used with those wheels on PYTHONPATH; otherwise the project's .venv. To fill .whl/
# for a Python 3.12 image that lacks the notebook stack (names and versions as in .venv):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
#     -d .whl ipykernel jupyter_client jupyter_core ipython ipython_pygments_lexers ipywidgets comm \
#     debugpy pyzmq tornado traitlets jedi parso pexpect ptyprocess prompt_toolkit wcwidth \
#     stack_data executing asttokens pure_eval platformdirs matplotlib-inline nest-asyncio2 \
#     jupyterlab_widgets widgetsnbextension nbclient nbformat fastjsonschema jsonschema \
#     jsonschema-specifications referencing rpds-py attrs
# and, for `prof.hta()` (tests/gpu/test_profile_gpu.py; the extra `fsdp2nb[profile]`):
#     holistictraceanalysis networkx plotly pydot pyparsing narwhals
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  site=/tmp/fsdp2nb-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PWD"
  py=python3
else
  [ -x .venv/bin/python ] || bash scripts/setup_venv.sh .venv
  py=.venv/bin/python
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi -L; nproc; "$py" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"; } 2>&1 | tee "$out/env.txt"
status=0
timeout "${GPU_TESTS_S:-220}" "$py" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o timeout=150 2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout "${GPU_BENCH_S:-320}" "$py" -m benchmarks.bench_gpu ${BENCH_GPU_ARGS:-} --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.txt" || status=1
# The GPU notebook on a Qwen2-shaped model of 0.49 B parameters made from a config (this machine
# reaches no hub), with the examples' character tokenizer; two GPUs as `--gpus 0,1` where there are.
model=/tmp/fsdp2nb-notebook-qwen2-0.5b
[ -f "$model/config.json" ] || "$py" -c "
import sys
from benchmarks.bench_gpu import HALF_BILLION
from fsdp2nb.examples import char_tokenizer
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
save_tiny_checkpoint(sys.argv[1], 'qwen2', tie_word_embeddings=True, with_tokenizer=False, **HALF_BILLION)
char_tokenizer().save_pretrained(sys.argv[1])" "$model" 2>&1 | tee "$out/finetune_gpu_model.txt"
gpus=$([ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo 0,1 || echo 1)
FSDP2NB_MODEL=$model FSDP2NB_GPUS=$gpus FSDP2NB_STEPS=${GPU_NOTEBOOK_STEPS:-10} FSDP2NB_OFFLOAD=${GPU_NOTEBOOK_OFFLOAD:-0} \
  timeout "${GPU_NOTEBOOK_S:-300}" "$py" scripts/run_demo.py notebooks/finetune_gpu.ipynb 2>&1 | tee "$out/finetune_gpu.txt" || status=1
cp notebooks/finetune_gpu.out.ipynb "$out/" 2>/dev/null
# The SFT notebook's GPU variant: TRL's SFTTrainer with LoRA on the same model and GPUs.
FSDP2NB_MODEL=$model FSDP2NB_GPUS=$gpus \
  timeout "${GPU_SFT_NOTEBOOK_S:-240}" "$py" scripts/run_demo.py notebooks/sft_trainer.ipynb 2>&1 | tee "$out/sft_trainer.txt" || status=1
cp notebooks/sft_trainer.out.ipynb "$out/" 2>/dev/null
exit $status
