"""What `%fsdp2?` and `%%fsdp2?` show: the magic's docstring (set in frontend/magics.py)."""

HELP = """Run notebook cells on persistent torch.distributed ranks.

Cell magic: the first %%fsdp2 cell starts the pool, later cells reuse it and its state::

    %%fsdp2 --cpu 2              # 2 CPU ranks joined by gloo
    %%fsdp2 --gpus 4             # ranks 0-3 on the first 4 visible GPUs (NCCL)
    %%fsdp2 --gpus 0,2,3         # ranks on GPUs 0, 2 and 3
    %%fsdp2 --ray --nodes 2 --gpus-per-node 8     # 16 ranks on 2 hosts of a Ray cluster
    %%fsdp2 --slurm --gpus-per-node 4            # inside salloc/sbatch: every allocated host
    %%fsdp2 --ranks 0            # only rank 0 of the running pool
    %%fsdp2 --profile            # then: each rank's compute, communication, waiting; a timeline
    x = torch.ones(1) * rank
    dist.all_reduce(x)

Every rank has `rank`, `local_rank`, `world_size`, `device`, `mesh` (a 1-D DeviceMesh),
`torch` and `dist` defined. Output is labelled by rank; a line every rank prints is shown
once as [all]. The stop button interrupts every rank. input(), getpass and breakpoint()
on a rank prompt in the notebook's input box, named by rank (`[0] (Pdb) `).

Background run: the cell returns a handle at once and its output streams into it::

    %%fsdp2 --bg --name train    # train.done(), train.wait(), train.interrupt(), train.state
    %fsdp2 wait [train]          # later cells that need the ranks wait for it anyway
    %fsdp2 interrupt [train]     # the stop button of an idle kernel leaves the run alone
    %fsdp2 runs                  # this session's background runs, one line each (x = %fsdp2 runs: the handles)

Line magic::

    %fsdp2 start --cpu 4 [--timeout 300]   # start a pool without running a cell
    %fsdp2 status                           # rank, pid, device, state, memory
    %fsdp2 push lr batch_size               # send notebook variables to every rank
    %fsdp2 pull loss step                   # define them in the notebook, from rank 0
    %fsdp2 pull w --rank 1                  # from rank 1 (a DTensor arrives whole)
    %fsdp2 pull loss --all                  # loss = {rank: value}
    w1 = %fsdp2 pull w --rank 1 --value     # returned: no notebook name is set
    %fsdp2 save [STEP]                      # save through the ranks' tracked Checkpointer
    %fsdp2 load [STEP|latest|memory]        # restore model, optimizer, RNG and step
    %fsdp2 dashboard                        # show the live dashboard (again)
    df = %fsdp2 metrics                     # what fsdp2nb.log recorded, as a table
    %fsdp2 debug [--rank R]                 # post-mortem of the last failed cell (pdb, as %debug)
    %fsdp2 stacks                           # every rank's Python stacks now; a running cell runs on
    %fsdp2 restart [--cpu 2]                # fresh pool, rank state is lost
    %fsdp2 stop

Profiles: `%%fsdp2 --profile` (or `with fsdp2nb.profile():` around steps in a cell)::

    prof = %fsdp2 profile                   # the last: prof.ranks, prof.straggler, prof.top_ops
    prof.trace_path                         # every rank on one clock, for ui.perfetto.dev

Memory, before loading (no pool needed; the model is built on meta, no weights read)::

    %fsdp2 plan meta-llama/Llama-3.1-8B --gpus 8 [--lora 16] [--batch 4] [--seq 4096]
    %fsdp2 plan ./my-model --cpu 4 [--fp32] [--ac] [--offload] [--memory 80GiB]
    # long names, as plan_memory's: --batch-size, --seq-len, --activation-checkpointing, --capacity

Kept pools outlive the kernel (docs/usage.md, "Kept pools")::

    %fsdp2 start --cpu 2 --keep [--name NAME] [--keep-for 2h|30m|90s|none]
    %fsdp2 pools                            # this user's kept pools (x = %fsdp2 pools: a list)
    %fsdp2 attach [NAME] [--take]           # hold one from this kernel; names on the ranks are there
    %fsdp2 detach                           # let go; the pool runs on

`pull` defines the names in the notebook, as `push` does on the ranks, and returns None
(so `y = %fsdp2 pull x` sets x, and y to None). With `--value` it defines no name and
returns the value instead (several names give a tuple, `--all` a dict rank -> value).
"""
