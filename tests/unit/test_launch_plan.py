from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan


def test_a_launch_request_decodes_to_the_plan_and_key_it_was_encoded_from():
    plan = LaunchPlan(pool_id="p1", world_size=2, backend="gloo",
                      ranks=(RankPlan(0, 0, "cpu"), RankPlan(1, 0, "cpu", node=1)), address="tcp://10.0.0.1:5000",
                      runtime_dir="/run/p1", log_dir="/log/p1", collective_timeout_s=60.0, kernel_pid=42,
                      master_port=29500, num_nodes=2, tls_fingerprint="ab" * 32)
    key = bytes(range(32))
    assert LaunchPlan.decode(plan.encode(key)) == (plan, key)
    assert plan.encode(key).decode().isascii()  # it travels inside the Ray driver's JSON lines too
