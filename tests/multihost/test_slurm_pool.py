"""A pool across two hosts inside a Slurm allocation, through a stand-in `srun` that starts one
task per test host as srun does (tests/support/fake_srun.py). The kernel runs on host 0."""


import pytest

from tests.support.fake_srun import write_srun
from tests.support.host_processes import kill_host_one_agent_mid_cell, wait_for_no_pool_processes
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

START = "%fsdp2 start --slurm --cpu-per-node 1 --listen {listen} --no-dashboard"


@pytest.fixture(scope="module")
def slurm_kernel(test_hosts, tmp_path_factory):
    import os

    bin_dir = tmp_path_factory.mktemp("slurm-bin")
    write_srun(bin_dir, test_hosts.names)
    env = {**WITHOUT_GPUS, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": str(len(test_hosts))}
    kernel = Kernel(env=env, argv_prefix=test_hosts[0].exec_prefix())
    assert kernel.execute("%load_ext fsdp2nb").status == "ok"
    run = kernel.execute(START.format(listen=test_hosts[0].address), timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    yield kernel
    kernel.stop()
    assert wait_for_no_pool_processes(test_hosts) == []


def test_one_srun_step_gives_one_group_across_hosts(slurm_kernel, test_hosts):
    run = slurm_kernel.execute("%%fsdp2\nimport os\nx = torch.ones(1)\ndist.all_reduce(x)\n"
                               "print(int(x.item()), os.environ['GLOO_SOCKET_IFNAME'], os.environ['SLURM_NODEID'])")
    assert run.status == "ok", run.traceback_text
    assert sorted(run.stdout.splitlines()) == [f"[{i}] 2 {host.interface} {i}" for i, host in enumerate(test_hosts)]
    status = slurm_kernel.execute("%fsdp2 status").stdout
    assert "--slurm --nodes 2" in status and all(f"({host.address})" in status for host in test_hosts)


def test_a_killed_agent_ends_the_step_and_the_cell_names_its_host(slurm_kernel, test_hosts):
    run = kill_host_one_agent_mid_cell(slurm_kernel, test_hosts)
    text = run.traceback_text + run.stderr
    assert run.status == "error" and f"on host {test_hosts[1].address} (node 1, ranks 1)" in text, text
    after = slurm_kernel.execute("%%fsdp2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(int(x.item()))", timeout=300)
    assert after.stdout == "[all] 2\n", after.stdout + after.stderr + after.traceback_text


def test_stopping_the_pool_ends_every_task(slurm_kernel, test_hosts):
    assert slurm_kernel.execute("%fsdp2 stop").status == "ok"
    assert wait_for_no_pool_processes(test_hosts) == []
    again = slurm_kernel.execute(START.format(listen=test_hosts[0].address), timeout=300)
    assert again.status == "ok", again.traceback_text
