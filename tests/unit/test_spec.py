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


# --- pools across hosts ----------------------------------------------------------------------


def _hosts(**options):
    from fsdp2nb.pool.spec import HostOptions

    return HostOptions(**options)


def test_a_ray_pool_spans_nodes_with_the_same_devices_on_each():
    spec = spec_from_options(gpus=None, cpu=None, hosts=_hosts(ray="auto", num_nodes=2, gpus_per_node=4))
    assert spec.world_size == 8 and spec.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert spec.describe() == "--ray auto --nodes 2 --gpus-per-node 4"
    cpu = spec_from_options(gpus=None, cpu=None, collective_timeout_s=60,
                            hosts=_hosts(ray="10.0.0.1:6379", num_nodes=3, cpu_per_node=1, listen="10.0.0.9"))
    assert cpu.world_size == 3 and cpu.backend == "gloo"
    assert cpu.describe() == "--ray 10.0.0.1:6379 --nodes 3 --listen 10.0.0.9 --cpu-per-node 1 --timeout 60"


@pytest.mark.parametrize(("options", "message"), [
    (dict(num_nodes=2, cpu_per_node=1), "add --ray"),
    (dict(ray="auto", slurm=True, num_nodes=2, cpu_per_node=1), "exclude each other"),
    (dict(ray="auto", num_nodes=2), "--gpus-per-node N or --cpu-per-node N"),
    (dict(ray="auto", num_nodes=2, gpus_per_node=1, cpu_per_node=1), "one of them"),
    (dict(ray="auto", cpu_per_node=1), "--nodes N is needed"),
    (dict(ray="auto", num_nodes=0, cpu_per_node=1), "at least 1"),
    (dict(ray="auto", num_nodes=2, cpu_per_node=0), "at least 1"),
    (dict(ray="auto", num_nodes=2, cpu_per_node=1, listen="0.0.0.0"), "every interface"),
    (dict(ray="auto", num_nodes=2, cpu_per_node=1, listen="head-node"), "not an IP address"),
])
def test_bad_host_options_get_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        spec_from_options(gpus=None, cpu=None, hosts=_hosts(**options))
    assert "\n" not in str(error.value)


def test_local_device_options_are_refused_across_hosts():
    with pytest.raises(ValueError, match="--gpus-per-node N or --cpu-per-node N"):
        spec_from_options(gpus="0,1", cpu=None, hosts=_hosts(ray="auto", num_nodes=2, gpus_per_node=2))


def test_slurm_needs_an_allocation_and_takes_its_node_count(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="inside a Slurm allocation"):
        spec_from_options(gpus=None, cpu=None, hosts=_hosts(slurm=True, cpu_per_node=1))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    spec = spec_from_options(gpus=None, cpu=None, hosts=_hosts(slurm=True, gpus_per_node=8))
    assert spec.world_size == 32 and spec.describe() == "--slurm --nodes 4 --gpus-per-node 8"
