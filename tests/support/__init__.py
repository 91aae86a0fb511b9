"""Harnesses that tests share, and benchmarks where a harness has no asserts of its own.

- `kernel_client`: drive a real ipykernel as a notebook front end does;
- `gloo_harness`: run a function on N CPU ranks joined by gloo;
- `netns`: hosts made of network namespaces on one machine (root only);
- `ray_cluster`: a Ray head and workers across those hosts;
- `fake_srun`: a stand-in for Slurm's `srun` that starts one task per host;
- `fault_campaign`: the seeded fault campaign of tests/faults, which checks recovery itself.

The tiny models that tests train are user-facing: `fsdp2nb.examples.tiny_models`.
"""
