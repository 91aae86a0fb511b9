"""A kept Ray pool's files without processes: each host's directory, the certificate a kernel that
attaches shows, and what `pool.json` says of its hosts."""

import json
import os
import secrets
import stat
import time

from fsdp2nb.pool.kept import holder, on_ray
from fsdp2nb.pool.kept.directory import read_activity, read_attach_record, write_attach_record
from fsdp2nb.pool.spec import Placement, PoolSpec
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.tls import load_pool_certificate, make_pool_certificate


def _request(kept_dir: str, key: bytes) -> str:
    ranks = tuple(RankPlan(rank=rank, local_rank=0, device="cpu", node=rank) for rank in range(2))
    plan = LaunchPlan(pool_id="p-1", world_size=2, backend="gloo", ranks=ranks, address="tcp://10.0.0.1:5000",
                      runtime_dir=os.path.join(kept_dir, "run"), log_dir="/tmp/x", collective_timeout_s=60.0,
                      kernel_pid=1, master_port=1, num_nodes=2, tls_fingerprint="ab", kept_dir=kept_dir)
    return plan.encode(key).decode()


def test_each_host_gets_a_private_directory_with_the_record_and_an_idle_board(tmp_path):
    key = secrets.token_bytes(32)
    kept_dir = tmp_path / "state" / "kept" / "rk"  # none of it exists on the other host yet
    record = AttachRecord(serial=4, address="tcp://10.0.0.1:5000", holder_pid=7, holder_start_time=1.0,
                          since=time.time())
    write_attach_record(str(tmp_path), Signer(key), record)
    directory = on_ray.prepare_host_dir(_request(str(kept_dir), key), 1, (tmp_path / "attach").read_bytes())
    assert directory == str(kept_dir / "node-1")
    for path in (tmp_path / "state", tmp_path / "state" / "kept", kept_dir, kept_dir / "node-1"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    assert stat.S_IMODE(os.stat(kept_dir / "node-1" / "attach").st_mode) == 0o600
    assert read_attach_record(directory, Signer(key)) == record
    assert [slot.running_cell_id for slot in read_activity(directory)] == [None, None]


def test_a_kernel_that_attaches_shows_the_certificate_the_ranks_were_launched_with(tmp_path):
    made = make_pool_certificate(str(tmp_path))
    loaded = load_pool_certificate(str(tmp_path))
    assert loaded == made
    other = tmp_path / "other"
    other.mkdir()
    make_pool_certificate(str(other))
    assert load_pool_certificate(str(other)).fingerprint != made.fingerprint


def test_pool_json_carries_the_hosts_of_a_ray_pool(tmp_path):
    placement = Placement(engine="ray", num_nodes=2, address="10.0.0.1:6379")
    meta = holder.KeptMeta(keep=holder.KeepOptions(name="rk", keep_for_s=None), pool_id="p-1", agent=(1, 2.0),
                         spec=PoolSpec(devices=("cpu",), collective_timeout_s=60.0, placement=placement),
                         log_dir="/l", runtime_dir="/r", created=3.0, listen="10.0.0.1")
    meta.write(tmp_path)
    read = holder.KeptMeta.read(tmp_path)
    assert read.spec == PoolSpec(devices=("cpu",), collective_timeout_s=60.0, placement=placement)
    assert read.spec.describe() == "--ray 10.0.0.1:6379 --nodes 2 --cpu-per-node 1 --timeout 60"
    made = make_pool_certificate(str(tmp_path))
    assert on_ray.attach_endpoint(read.listen, str(tmp_path)) == ("tcp://10.0.0.1:0", made)


def test_pool_json_keeps_its_flat_layout(tmp_path):
    """A kernel of an earlier release reads pool.json to list pools, and removes the directory of
    one it cannot read: the file's fields stay as they were."""
    placement = Placement(engine="ray", num_nodes=2, address="10.0.0.1:6379")
    holder.KeptMeta(keep=holder.KeepOptions(name="rk", keep_for_s=90.0), pool_id="p-1", agent=(1, 2.0),
                  spec=PoolSpec(devices=("cpu", "cpu"), collective_timeout_s=60.0, placement=placement),
                  log_dir="/l", runtime_dir="/r", created=3.0, listen="10.0.0.1").write(tmp_path)
    assert json.loads((tmp_path / "pool.json").read_text()) == {
        "name": "rk", "pool_id": "p-1", "devices": ["cpu", "cpu"], "collective_timeout_s": 60.0,
        "keep_for_s": 90.0, "agent": [1, 2.0], "log_dir": "/l", "runtime_dir": "/r", "created": 3.0,
        "placement": {"engine": "ray", "num_nodes": 2, "address": "10.0.0.1:6379", "listen": None},
        "listen": "10.0.0.1"}


def test_a_local_kept_pools_json_still_reads_without_hosts(tmp_path):
    (tmp_path / "pool.json").write_text(
        '{"name": "a", "pool_id": "p", "devices": ["cpu"], "collective_timeout_s": 600.0, "keep_for_s": 3600.0,'
        ' "agent": [1, 2.0], "log_dir": "/l", "runtime_dir": "/r", "created": 3.0}')
    meta = holder.KeptMeta.read(tmp_path)
    assert meta.spec.placement is None and meta.listen == ""
