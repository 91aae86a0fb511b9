import pytest

from fsdp2nb.pool import spec as spec_module
from fsdp2nb.pool.spec import PoolSpec, parse_rank_list, spec_from_options


def test_cpu_ranks_and_backend():
    spec = spec_from_options(gpus=None, cpu=3)
    assert spec.devices == ("cpu",) * 3 and spec.backend == "gloo" and spec.describe() == "--cpu 3"


@pytest.mark.parametrize(("gpus", "devices"), [("2", ("cuda:0", "cuda:1")), ("0,2,3", ("cuda:0", "cuda:2", "cuda:3")),
                                                ("1,", ("cuda:1",))])
def test_gpu_counts_and_lists(monkeypatch, gpus, devices):
    monkeypatch.setattr(spec_module, "visible_gpu_indices", lambda: [0, 1, 2, 3])
    spec = spec_from_options(gpus=gpus, cpu=None)
    assert spec.devices == devices and spec.backend == "cuda:nccl,cpu:gloo"


@pytest.mark.parametrize(("gpus", "message"), [("0", "at least 1"), ("-1", "-1 must be at least 1"), ("5", "more GPUs than the 4"),
                                               ("0,9", "index 9"), ("a", "neither a count"), ("1,1", "twice")])
def test_bad_gpu_options(monkeypatch, gpus, message):
    monkeypatch.setattr(spec_module, "visible_gpu_indices", lambda: [0, 1, 2, 3])
    with pytest.raises(ValueError, match=message):
        spec_from_options(gpus=gpus, cpu=None)


def test_gpus_without_cuda_suggest_cpu(monkeypatch):
    monkeypatch.setattr(spec_module, "visible_gpu_indices", lambda: [])
    with pytest.raises(ValueError, match="--cpu N"):
        spec_from_options(gpus="2", cpu=None)


def test_rank_lists():
    assert parse_rank_list("0,2", 4) == (0, 2)
    assert parse_rank_list("1-3", 4) == (1, 2, 3)
    with pytest.raises(ValueError, match="rank 7 does not exist"):
        parse_rank_list("7", 2)
    with pytest.raises(ValueError, match="not a rank list"):
        parse_rank_list("x", 2)


def test_spec_validates_devices():
    with pytest.raises(ValueError, match="all 'cpu' or all 'cuda:N'"):
        PoolSpec(devices=("cpu", "cuda:0"))
