"""A pool across two hosts through a real Ray cluster, driven from a real kernel on host 0.

The hosts are network namespaces (tests/multihost/conftest.py): each has its own address and
loopback, and traffic between them crosses a veth pair. The kernel runs in host 0's namespace, as
a notebook on a cluster's head node would; Ray places one host agent on each host. The tests share
one kernel and run in order: the last one SIGKILLs it.
"""

import re

import psutil
import pytest

from tests.support.host_processes import (
    host_agents,
    kill_host_one_agent_mid_cell,
    pool_processes,
    runs_module,
    wait_for_no_pool_processes,
)
from tests.support.kernel_client import WITHOUT_GPUS, Kernel
from tests.support.training_cells import SETUP, losses

pytestmark = pytest.mark.timeout(900)  # the package's Ray cluster starts inside the first test

START = "%fsdp2 start --ray {address} --nodes 2 --cpu-per-node 1 --no-dashboard"
TRAIN = ("%%fsdp2\nfor step in range(3):\n    loss = train_step(step)\n"
         "    if rank == 0: print(f'step {step} loss {loss:.6f}')")


@pytest.fixture(scope="module")
def ray_kernel(test_hosts, ray_cluster):
    kernel = Kernel(env={**ray_cluster.driver_env(), **WITHOUT_GPUS}, argv_prefix=test_hosts[0].exec_prefix())
    assert kernel.execute("%load_ext fsdp2nb").status == "ok"
    run = kernel.execute(START.format(address=ray_cluster.address), timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    kernel.start_run = run
    yield kernel
    kernel.stop()
    assert wait_for_no_pool_processes(test_hosts) == []


def test_ranks_on_two_hosts_form_one_group_and_keep_state(ray_kernel, test_hosts):
    run = ray_kernel.execute("%%fsdp2\nimport os\nx = torch.ones(1)\ndist.all_reduce(x)\n"
                             "where = os.environ['GLOO_SOCKET_IFNAME'], os.environ['MASTER_ADDR']\n"
                             "print(int(x.item()), where[0])")
    assert run.status == "ok", run.traceback_text
    lines = dict(re.findall(r"\[(\d)\] 2 (\S+)", run.stdout))
    assert set(lines.values()) == {host.interface for host in test_hosts}, run.stdout
    again = ray_kernel.execute("%%fsdp2\nprint(where[1] in ('10.213.0.1', '10.213.0.2'), int(x.item()))")
    assert again.stdout == "[all] True 2\n"
    status = ray_kernel.execute("%fsdp2 status").stdout
    assert all(f"({host.address})" in status for host in test_hosts), status
    assert "idle" in status and " MiB" in status  # every rank's snapshots reach the kernel


def test_the_start_warns_that_ray_has_no_token_authentication(ray_kernel):
    assert "token authentication is off" in ray_kernel.start_run.stderr


def test_the_pool_listens_only_on_cluster_addresses(ray_kernel, test_hosts):
    """The kernel's TLS listener, rank 0's store and gloo: on a host's own address (or loopback),
    never a wildcard. (Ray's servers, the Ray driver's included, listen as Ray chooses.)"""
    ours = {ray_kernel.pid, *(process.pid for process in pool_processes(test_hosts)
                              if not runs_module(process, "fsdp2nb.pool.ray_driver"))}
    listening = []
    for host in test_hosts:
        table = host.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        listening += [line.split()[3] for line in table.splitlines()
                      if {int(pid) for pid in re.findall(r"pid=(\d+)", line)} & ours]
    hosts = {address.rsplit(":", 1)[0] for address in listening}
    assert test_hosts[0].address in hosts and hosts <= {"127.0.0.1", *(host.address for host in test_hosts)}, \
        listening


def test_output_errors_and_interrupts_behave_as_on_one_host(ray_kernel):
    failed = ray_kernel.execute("%%fsdp2\nif rank == 1:\n    raise ValueError('host one says no')\nprint('fine')")
    assert failed.status == "error" and "host one says no" in failed.traceback_text
    assert "[0] fine" in failed.stdout
    interrupted = ray_kernel.execute_and_interrupt(
        "%%fsdp2\nimport time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.05)", "looping")
    assert interrupted.status == "error" and "KeyboardInterrupt" in interrupted.traceback_text
    after = ray_kernel.execute("%%fsdp2\nprint(int(x.item()))")
    assert after.stdout == "[all] 2\n"  # state survived the interrupt


def test_killing_one_hosts_agent_ends_the_cell_naming_host_and_rank(ray_kernel, test_hosts):
    run = kill_host_one_agent_mid_cell(ray_kernel, test_hosts)
    assert run.status == "error"
    text = run.traceback_text + run.stderr
    assert f"on host {test_hosts[1].address}" in text and "was killed by SIGKILL" in text, text
    after = ray_kernel.execute("%%fsdp2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(int(x.item()))", timeout=300)
    assert after.stdout == "[all] 2\n", after.stdout + after.stderr + after.traceback_text


def test_training_matches_one_host_and_the_checkpoint_loads_on_one_rank(ray_kernel, tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts-training")  # shared by both namespaces: one filesystem
    paths = f"model_dir = {str(root / 'model')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
    assert ray_kernel.execute(paths + "%fsdp2 push model_dir ckpt_dir").status == "ok"
    assert ray_kernel.execute(SETUP, timeout=300).status == "ok"
    two_hosts = ray_kernel.execute(TRAIN, timeout=300)
    assert two_hosts.status == "ok", two_hosts.traceback_text
    assert ray_kernel.execute("%fsdp2 save 3").status == "ok"
    saved = ray_kernel.execute("%%fsdp2\nprint(round(sum(p.full_tensor().double().sum().item() "
                               "for p in model.parameters()), 9))").stdout

    local = ray_kernel.execute("%fsdp2 restart --cpu 2", timeout=300)
    assert local.status == "ok", local.traceback_text
    paths = f"model_dir = {str(root / 'model1')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
    assert ray_kernel.execute(paths + "%fsdp2 push model_dir ckpt_dir").status == "ok"
    assert ray_kernel.execute(SETUP.replace("keep=2", "keep=5"), timeout=300).status == "ok"
    one_host = ray_kernel.execute(TRAIN.replace("range(3)", "range(3)"), timeout=300)
    assert losses(one_host.stdout) == losses(two_hosts.stdout) != []

    assert ray_kernel.execute("%fsdp2 restart --cpu 1", timeout=300).status == "ok"
    assert ray_kernel.execute(paths + "%fsdp2 push model_dir ckpt_dir").status == "ok"
    assert ray_kernel.execute(SETUP, timeout=300).status == "ok"
    loaded = ray_kernel.execute("%fsdp2 load 3")
    assert loaded.status == "ok", loaded.traceback_text + loaded.stderr
    restored = ray_kernel.execute("%%fsdp2\nprint(round(sum(p.full_tensor().double().sum().item() "
                                  "for p in model.parameters()), 9))").stdout
    assert restored.split()[-1] == saved.split()[-1]


HSDP_SETUP = SETUP.replace("model, tokenizer = fsdp2nb.load_model(", "hosts_mesh = fsdp2nb.hsdp_mesh()\n"
                           "model, tokenizer = fsdp2nb.load_model(").replace(
    'FSDP2Engine(mixed_precision="fp32")', 'FSDP2Engine(mixed_precision="fp32", mesh=hosts_mesh)')
PARAMETER_SUM = ("%%fsdp2\nprint(round(sum(p.full_tensor().double().sum().item() "
                 "for p in model.parameters()), 9))")


@pytest.mark.soak  # HSDP itself is tested on one host (tests/distributed/test_hsdp.py); across hosts with `make soak`
def test_hsdp_over_two_hosts_trains_as_the_flat_mesh_and_its_checkpoint_loads_flat(ray_kernel, ray_cluster,
                                                                                  tmp_path_factory):
    """2 hosts x 2 ranks: `hsdp_mesh()` makes one row per host, and training on it gives the
    flat mesh's losses; its checkpoint loads into the flat mesh of the same pool."""
    four = START.format(address=ray_cluster.address).replace("start", "restart").replace("per-node 1", "per-node 2")
    started = ray_kernel.execute(four, timeout=300)
    assert started.status == "ok", started.traceback_text + started.stderr
    root = tmp_path_factory.mktemp("hsdp-hosts")
    paths = f"model_dir = {str(root / 'model')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
    assert ray_kernel.execute(paths + "%fsdp2 push model_dir ckpt_dir").status == "ok"
    setup = ray_kernel.execute(HSDP_SETUP, timeout=300)
    assert setup.status == "ok", setup.traceback_text + setup.stderr
    rows = ray_kernel.execute("%%fsdp2\nimport os\nprint(hosts_mesh.get_coordinate()[0] == int(os.environ['GROUP_RANK']), "
                              "hosts_mesh.shape, next(model.parameters()).placements, mesh.shape)")
    assert rows.stdout == "[all] True (2, 2) (Replicate(), Shard(dim=0)) (4,)\n", rows.stdout + rows.traceback_text
    hsdp = ray_kernel.execute(TRAIN, timeout=300)
    assert hsdp.status == "ok", hsdp.traceback_text
    assert ray_kernel.execute("%fsdp2 save 3").status == "ok"
    saved = ray_kernel.execute(PARAMETER_SUM).stdout

    assert ray_kernel.execute(SETUP.replace("keep=2", "keep=5"), timeout=300).status == "ok"  # the flat mesh
    flat = ray_kernel.execute(TRAIN, timeout=300)
    assert [float(x) for x in losses(hsdp.stdout)] == pytest.approx([float(x) for x in losses(flat.stdout)],
                                                                     rel=1e-5, abs=2e-6)
    assert len(losses(flat.stdout)) == 3
    loaded = ray_kernel.execute("%fsdp2 load 3")
    assert loaded.status == "ok", loaded.traceback_text + loaded.stderr
    assert ray_kernel.execute(PARAMETER_SUM).stdout.split()[-1] == saved.split()[-1]
    assert ray_kernel.execute("%fsdp2 restart --cpu 1", timeout=300).status == "ok"  # as the training test left it


def test_a_restart_ends_the_old_pool_and_killing_the_kernel_leaves_no_process(ray_kernel, test_hosts,
                                                                               ray_cluster):
    before = pool_processes(test_hosts)  # the one-rank pool the training test left, and its standby agent
    old_pool = [process for agent in host_agents(test_hosts) if agent.children()
                for process in (agent, *agent.children())]  # a standby has forked no rank
    started = ray_kernel.execute(START.format(address=ray_cluster.address).replace("start", "restart"),
                                 timeout=300)
    assert started.status == "ok", started.traceback_text + started.stderr
    _, alive = psutil.wait_procs(old_pool, timeout=60)
    assert len(old_pool) == 2 and alive == []
    mine = [process for process in pool_processes(test_hosts) if process.pid not in {p.pid for p in before}]
    assert len(mine) == 5  # the driver, two agents, two ranks
    everything = pool_processes(test_hosts)
    psutil.Process(ray_kernel.pid).kill()
    _, alive = psutil.wait_procs(everything, timeout=60)
    assert alive == []
