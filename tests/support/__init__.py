"""What several test modules share, so that no test module imports another.

Harnesses, which benchmarks may use too (they assert nothing of their own):
- `kernel_client`: drive a real ipykernel as a notebook front end does;
- `gloo_harness`: run a function on N CPU ranks joined by gloo;
- `netns`: hosts made of network namespaces on one machine (root only);
- `ray_cluster`: a Ray head and workers across those hosts;
- `fake_srun`: a stand-in for Slurm's `srun` that starts one task per host.

Test helpers, with checks of their own (benchmarks import none of them):
- `fault_campaign`: the seeded fault campaign of tests/faults, which checks recovery itself;
  `fault_cells`, the notebook it trains; `fault_report`, its records and table;
- `training_cells`: the tiny Llama set-up cell of the kernel and multi-host training tests;
- `dashboard_comms`: the dashboard's comms as a front end sees them, and clicks on its buttons;
- `lab_page`: a notebook open in JupyterLab or Notebook 7, and the training cells put in it;
- `channels`: a log kept in a list and waits, for tests of the pool's channels;
- `host_processes`: fsdp2nb's processes on test hosts, killing a host's agent mid-cell;
- `checkpoint_helpers`: the checkpoint tests' sharded tiny model, training step and full states.

The tiny models that tests train are user-facing: `fsdp2nb.examples.tiny_models`.
"""
