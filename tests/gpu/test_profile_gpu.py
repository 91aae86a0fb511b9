"""`%%fsdp2 --profile` on GPU ranks: CUDA kernels in the profile, the overlapped share in the
table, and Holistic Trace Analysis on the ranks' own traces (`fsdp2nb[profile]`). Run by
scripts/gpu_check.sh."""

import json

import pytest
import torch

from tests.support.kernel_client import Kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]

PROFILED = """%%fsdp2 --profile
a = torch.randn(2048, 2048, device=device)
x = torch.ones(16 * 2**20, device=device)
for _ in range(4):
    b = a @ a
    dist.all_reduce(x)
torch.cuda.synchronize()
"""


@pytest.fixture(scope="module")
def profiled_kernel():
    k = Kernel()
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    num_gpus = min(torch.cuda.device_count(), 2)
    run = k.execute(f"%fsdp2 start --gpus {num_gpus} --no-dashboard")
    assert run.status == "ok", run.stderr
    run = k.execute(PROFILED)
    assert run.status == "ok", run.traceback_text
    assert k.execute("prof = %fsdp2 profile").status == "ok"
    k.num_gpus = num_gpus
    k.shown = "".join(d["data"].get("text/html", "") for d in run.displays)
    yield k
    k.stop()


def _value(kernel, expression: str):
    run = kernel.execute(f"import json as _json\nprint(_json.dumps({expression}))")
    assert run.status == "ok", run.traceback_text
    return json.loads(run.stdout)


def test_gpu_ranks_profile_kernels_and_show_the_overlapped_share(profiled_kernel):
    assert "overlapped" in profiled_kernel.shown
    kinds = _value(profiled_kernel, "sorted({e['cat'] for e in _json.load(open(prof.trace_path))['traceEvents'] "
                                    "if e.get('ph') == 'X'})")
    assert "gpu kernel" in kinds, kinds
    if profiled_kernel.num_gpus > 1:
        assert "gpu collective" in kinds, kinds
    for wall, compute, communication, idle in _value(
            profiled_kernel, "[(r.wall_s, r.compute_s, r.communication_s, r.idle_s) for r in prof.ranks]"):
        assert compute + communication + idle == pytest.approx(wall, abs=1e-6)


def test_holistic_trace_analysis_reads_the_ranks_traces(profiled_kernel):
    pytest.importorskip("hta", reason="Holistic Trace Analysis: pip install 'fsdp2nb[profile]'")
    ranks = _value(profiled_kernel, "sorted(prof.hta()['temporal']['rank'].tolist())")
    assert ranks == list(range(profiled_kernel.num_gpus))
    assert _value(profiled_kernel, "len(prof.hta()['overlap'])") == profiled_kernel.num_gpus
