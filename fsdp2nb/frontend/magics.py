"""The `%fsdp2` line magic and `%%fsdp2` cell magic: parse, build one request, call the session."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand

from fsdp2nb.errors import InvalidValue, NoPoolRunning, PoolStartError, RankError, UsageMistake
from fsdp2nb.frontend.errors import alarm
from fsdp2nb.frontend.magic_help import HELP
from fsdp2nb.frontend.magic_options import (
    COMMANDS,
    cell_options,
    keep_options,
    line_parsers,
    plan_ranks,
    spec_or_none,
    split_magic_line,
)
from fsdp2nb.frontend.pool_requests import SentCell
from fsdp2nb.frontend.profiles import ProfileCollector, describe_stacks
from fsdp2nb.frontend.rank_clocks import ClockOffsets, estimate_offsets, spans_hosts
from fsdp2nb.frontend.session import RESTORE_HINT, NotebookSession
from fsdp2nb.host.rank_logs import rank_log_path
from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.pool.kept.holder import (
    KeepOptions,
    describe_deaths,
    describe_ranks,
)
from fsdp2nb.pool.spec import PoolSpec, default_spec, parse_rank_list
from fsdp2nb.wire.requests import (
    LoadCheckpoint,
    RankCommand,
    ReportStacks,
    RunCommand,
    SaveCheckpoint,
    SaveIfRequested,
)

if TYPE_CHECKING:
    from fsdp2nb.frontend.cell_ahead import CellsAhead
    from fsdp2nb.frontend.dashboard_link import DashboardLink

_WAIT_FOR_RUN = frozenset(("start", "stop", "restart", "push", "pull", "save", "load", "debug"))
"""Commands that need the ranks, so wait for a background run as a later cell does."""
_STACKS_WAIT_S = 10.0
"""How long `%fsdp2 stacks` waits for the ranks' control threads before naming those that did not answer."""
_REFUSALS_IN_ONE_LINE = frozenset(("NoTrackedCheckpointer", "CheckpointLoadError", "MemorySnapshotRefused"))
"""Errors of `%fsdp2 save`/`load` that changed nothing and say what to do: shown without tracebacks."""


def _exited_ranks(pool: PoolHandle) -> Collection[int]:
    """The ranks that will send nothing more: those that exited, or all once the pool is not ready."""
    return pool.exited.keys() if pool.state == "ready" else range(pool.world_size)


@magics_class
class FSDP2Magics(Magics):
    """Registers `%fsdp2` / `%%fsdp2` on a shell; all state lives in the session."""

    def __init__(self, shell: InteractiveShell, session: NotebookSession,
                 cells_ahead: CellsAhead | None = None) -> None:
        super().__init__(shell)
        self._shell = shell
        """The shell the magics serve (IPython's `self.shell` may be None, by its types)."""
        self.session = session
        self._cells_ahead = cells_ahead
        """Plain cells sent to the ranks at `pre_run_cell`, which the cell magic only waits for."""
        self._line_parsers = line_parsers()
        self._profiles = ProfileCollector()
        """The ranks' profiles and stacks as they arrive (`%%fsdp2 --profile`, `%fsdp2 stacks`)."""
        session.add_snapshot_listener(self._profiles.hear)
        self._clock_pool: PoolHandle | None = None
        self._offsets: ClockOffsets | None = None
        """The pool whose ranks' clock offsets were measured, and those offsets."""

    @no_var_expand  # done by _expand_variables, only for a line that asks for it
    @line_cell_magic
    def fsdp2(self, line: str, cell: str | None = None):
        # The docstring, shown by `%fsdp2?`, is HELP (frontend/magic_help.py), set below.
        try:
            sent = self._cells_ahead.claim(line, cell) if self._cells_ahead is not None else None
            if sent is not None:
                return self._finish_cell_sent_ahead(sent)
            line = self._expand_variables(line)
            self._wait_for_background_run(line, cell)
            if cell is not None:
                return self._run_cell(line, cell)
            return self._run_command(line)
        except UsageMistake as error:  # one line; any other error is a failure, with its traceback
            raise UsageError(str(error)) from None
        except PoolStartError as error:
            raise UsageError(f"the pool did not start: {error}") from None

    fsdp2.__doc__ = HELP

    def _expand_variables(self, line: str) -> str:
        """`$name` and `{expression}` in the line, as IPython expands them for other magics.

        IPython's expansion copies the whole notebook namespace (which grows by a few names with
        every cell run) on every call, so it is asked for only when the line has `$` or `{`.
        Depth 3 reaches the frame that called the magic: ours, run_*_magic's, then the caller's.
        """
        if "$" not in line and "{" not in line:
            return line
        return self._shell.var_expand(line, depth=3)

    # --- %%fsdp2 --------------------------------------------------------------------------------

    def _run_cell(self, line: str, cell: str):
        options = cell_options(line)
        keep = keep_options(options, cell=True)
        if options.profile and options.bg:
            raise InvalidValue("--profile shows its profile under the cell, so it runs in the foreground: drop --bg, "
                               "or use `with fsdp2nb.profile():` in the run and `%fsdp2 profile` once it ended")
        if options.bg or (options.name is not None and keep is None):
            return self._run_in_background(options, cell, keep)
        spec = spec_or_none(options)
        spec = self._with_running_devices(spec, options)
        world_size = self.session.pool.world_size if self.session.pool and spec is None else None
        world_size = world_size or (spec or default_spec()).world_size
        ranks = parse_rank_list(options.ranks, world_size) if options.ranks else tuple(range(world_size))
        if not cell.strip():
            cell = ""
        starting = self.session.pool is None
        pool = self.session.pool_for(spec, default_spec, keep)
        if starting and not options.no_dashboard:
            self._dashboard().show()  # under the cell that starts the pool, above its output
        self._profiles.take_new()  # a background run's, ended before this cell: `%fsdp2 profile` has them
        if options.profile:
            self._run_profiled_cell(pool, cell, ranks)
        else:
            try:
                self.session.requests.run_cell(pool, cell, ranks)
            finally:  # a cell that failed shows what ran until then
                self._show_new_profiles(pool)
        self._serve_dashboard_save(pool)

    def _run_profiled_cell(self, pool: PoolHandle, cell: str, ranks: tuple[int, ...]) -> None:
        """`%%fsdp2 --profile`: the ranks send their profiles after their replies, so the cell
        ends with a placeholder that the profile replaces once every rank's has come."""
        from fsdp2nb.frontend.cell_transform import notebook_execution_count
        from fsdp2nb.frontend.profile_display import show_when_complete

        sent = self.session.requests.send_cell(pool, cell, ranks, notebook_execution_count(), profile=True)
        pending = self._profiles.expect(sent.wait.cell_id, ranks)
        try:
            self.session.requests.finish_cell(sent)
        finally:  # a cell that failed or was stopped shows what ran until then
            pending.clock_offsets = self._clock_offsets(pool)
            show_when_complete(self._profiles, pending, lambda: _exited_ranks(pool), self._tell_dashboard)

    def _tell_dashboard(self, analysis) -> None:
        for listener in list(self.session.snapshot_listeners):
            listener(analysis)

    def _finish_cell_sent_ahead(self, sent: SentCell) -> None:
        try:
            self.session.requests.finish_cell(sent)
        finally:
            self._show_new_profiles(sent.wait.pool, sent.wait.cell_id)
        self._serve_dashboard_save(sent.wait.pool)

    def _show_new_profiles(self, pool: PoolHandle, cell_id: int | None = None) -> None:
        """The profiles the cell's ranks sent (`--profile`, `fsdp2nb.profile()`), under its output,
        and the last one's bars to the dashboard; with `cell_id`, that request's only."""
        from IPython.display import display

        profiles = self._profiles.take_new(self._clock_offsets(pool) if self._profiles.has_new() else None)
        profiles = [profile for profile in profiles if cell_id is None or profile.analysis.cell_id == cell_id]
        for profile in profiles:
            display(profile)
        if profiles:
            self._tell_dashboard(profiles[-1].analysis)

    def _run_in_background(self, options, cell: str, keep: KeepOptions | None = None):
        """`%%fsdp2 --bg`: start the run and return its handle (bound to --name if given)."""
        from fsdp2nb.frontend.background import check_run_name

        if not options.bg:
            raise InvalidValue("--name names a background run; use it with --bg")
        check_run_name(options.name)
        pool = self.session.pool_for(self._with_running_devices(spec_or_none(options), options), default_spec, keep)
        ranks = parse_rank_list(options.ranks, pool.world_size) if options.ranks else tuple(range(pool.world_size))
        run = self.session.requests.run_in_background(pool, cell if cell.strip() else "", ranks, options.name)
        if options.name:
            self._shell.user_ns[options.name] = run
        return run

    def _wait_for_background_run(self, line: str, cell: str | None) -> None:
        """A cell or command that needs the ranks waits for the run going, as it would in sequence."""
        if cell is None:
            words = line.split(maxsplit=1)
            if not words or words[0] not in _WAIT_FOR_RUN:
                return
        self.session.requests.background.wait_for_active(sys.stdout.write)

    def _serve_dashboard_save(self, pool: PoolHandle) -> None:
        """A save clicked during the cell that no maybe_save reached is made now, on this thread."""
        link = self.session.dashboard  # None: no dashboard was shown
        if link is not None and link.take_unserved_request():
            self._run_on_ranks(SaveIfRequested())

    # --- %fsdp2 COMMAND -----------------------------------------------------------------------

    def _run_command(self, line: str):
        words = split_magic_line(line)
        if not words or words[0] not in COMMANDS:
            given = f"'{words[0]}'" if words else "nothing"
            raise UsageMistake(f"%fsdp2 takes one of {', '.join(COMMANDS)}, got {given}; see %fsdp2?")
        command, options = words[0], self._line_parsers[words[0]].parse_args(words[1:])
        return getattr(self, f"_command_{command}")(options)

    def _with_running_devices(self, spec: PoolSpec | None, options) -> PoolSpec | None:
        """`--timeout` alone keeps the devices of the running pool (or the default ones)."""
        if spec is None or options.gpus is not None or options.cpu is not None or spec.placement is not None:
            return spec
        base = self.session.pool.spec if self.session.pool else default_spec()
        return PoolSpec(devices=base.devices, collective_timeout_s=spec.collective_timeout_s, placement=base.placement)

    def _command_start(self, options) -> None:
        keep = keep_options(options)
        pool = self.session.start(self._with_running_devices(spec_or_none(options), options) or default_spec(), keep)
        print(f"started {pool.world_size} ranks ({pool.spec.describe()})"
              + (f", kept as {keep.name!r}: `%fsdp2 attach {keep.name}` in another kernel uses it" if keep else ""))
        if not options.no_dashboard:
            self._dashboard().show()

    def _command_pools(self, options):
        """This user's kept pools: a list (`x = %fsdp2 pools`) that shows as one line per pool."""
        from fsdp2nb.pool.kept.listing import list_pools

        return list_pools()

    def _command_attach(self, options) -> None:
        from fsdp2nb.pool.kept.holder import log_tails

        pool, run = self.session.attach(options.name, take=options.take)
        assert pool.keep is not None, "an attached pool is kept"
        print(f"attached kept pool {pool.keep.name!r}: {pool.world_size} ranks ({pool.spec.describe()}), "
              "rank state as it was")
        if pool.exited:
            print(alarm(f"{describe_deaths(pool.exited.values())} while no kernel held the pool; the other "
                        "ranks kept their state, but cells need every rank: `%fsdp2 restart` starts them all "
                        "afresh (rank state is lost)"), file=sys.stderr)
        for rank, lines in log_tails(pool.log_dir, pool.world_size).items():
            if lines:
                print(f"last lines of rank {rank}'s log ({rank_log_path(pool.log_dir, rank)}):")
                print("\n".join(f"  {line}" for line in lines))
        if run is not None:
            self._tell_of_resumed_run(pool, run)
        if not options.no_dashboard:
            self._dashboard().show()

    def _tell_of_resumed_run(self, pool: PoolHandle, run) -> None:  # a BackgroundRun
        """The run this kernel took over: bound to its --name here too, and whether it waits for input."""
        if run.name and run.name.isidentifier():
            self._shell.user_ns[run.name] = run
        work = dict(enumerate(pool.work_at_attach))
        running = [rank for rank in run.ranks if rank in work and work[rank].running_cell_id is not None]
        if not running:
            print(f"{run.label} ended while no kernel held the pool; `%fsdp2 wait` shows how")
            return
        print(f"{run.label} is still running on {describe_ranks(running)}; `%fsdp2 wait` waits for it, "
              "`%fsdp2 interrupt` stops it")
        waiting = [rank for rank in running if work[rank].waiting_for_input]
        if waiting:
            print(f"{describe_ranks(waiting)} of {run.label} {'waits' if len(waiting) == 1 else 'wait'} for input "
                  "(input(), getpass or the debugger): `%fsdp2 wait` asks here, as the cell would have")

    def _command_detach(self, options) -> None:
        name = self.session.detach()
        print(f"detached: kept pool {name!r} runs on; `%fsdp2 attach {name}` in any kernel of yours uses it")

    def _command_restart(self, options) -> None:
        pool = self.session.restart(self._with_running_devices(spec_or_none(options), options))
        kept = self.session.kept_in_memory()
        kept_note = f"; {kept} is kept in memory: {RESTORE_HINT}" if kept else ""
        print(f"restarted: {pool.world_size} fresh ranks ({pool.spec.describe()}); rank state was cleared{kept_note}")

    def _command_stop(self, options) -> None:
        with self.session.lifecycle_lock:
            self.session.check_held()  # a pool another kernel took is not this kernel's to end
        print("pool stopped" if self.session.stop() else "no pool is running")

    def _command_status(self, options) -> None:
        from fsdp2nb.frontend.status import status_table

        print(status_table(self.session.pool))

    def _command_push(self, options) -> None:
        pool = self._running_pool()
        missing = [name for name in options.names if name not in self._shell.user_ns]
        if missing:
            raise UsageMistake(f"cannot push {missing[0]!r}: it is not defined in the notebook")
        values = {name: self._shell.user_ns[name] for name in options.names}
        self.session.requests.push(pool, _pickle_for_ranks(values))

    def _command_pull(self, options):
        """The names are defined in the notebook; with --value, returned instead."""
        pool = self._running_pool()
        reply_ranks = tuple(range(pool.world_size)) if options.all else (options.rank or 0,)
        if not 0 <= reply_ranks[0] < pool.world_size:
            raise InvalidValue(f"--rank {reply_ranks[0]} does not exist: the pool has ranks 0-{pool.world_size - 1}")
        for name in options.names:
            if not name.isidentifier():
                raise InvalidValue(f"cannot pull {name!r}: it is not a Python name")
        # Every value arrives before any name is set: a failed pull changes nothing.
        values = {name: self._pull_one(pool, name, reply_ranks, options.all) for name in options.names}
        if options.value:
            return values[options.names[0]] if len(values) == 1 else tuple(values.values())
        self._shell.user_ns.update(values)
        return None

    def _pull_one(self, pool: PoolHandle, name: str, reply_ranks: tuple[int, ...], every_rank: bool) -> object:
        payloads = self.session.requests.pull(pool, name, reply_ranks)
        values = {rank: pickle.loads(payload) for rank, payload in payloads.items()}
        return values if every_rank else values[reply_ranks[0]]

    def _command_save(self, options) -> None:
        self._run_checkpoint_command(SaveCheckpoint(step=options.step))

    def _command_load(self, options) -> None:
        target = options.target
        if target not in ("latest", "memory") and not (target.isascii() and target.isdigit()):
            raise InvalidValue(f"%fsdp2 load takes 'latest', 'memory' or a step number, got {target!r}")
        self._run_checkpoint_command(LoadCheckpoint(target=int(target) if target.isdigit() else target))

    def _run_checkpoint_command(self, command: RankCommand) -> None:
        """Save or load on the ranks. No tracked checkpointer, or a step that cannot be loaded
        (loading changed nothing), is shown as one line, without the ranks' tracebacks."""
        try:
            self._run_on_ranks(command)
        except RankError as error:
            refused = [info for _, info in error.errors if info.ename in _REFUSALS_IN_ONE_LINE]
            if refused:
                raise UsageMistake(refused[0].evalue) from None
            raise

    def _command_wait(self, options) -> None:
        run = self._background_runs().find(options.name)
        run.wait_for_end()  # the stop button ends this wait, not the run
        if run.output_at:  # taken over on attach: its output went under that cell, so say how it ended here
            print(run.ending_line())
        run.raise_error()

    def _command_interrupt(self, options) -> None:
        run = self._background_runs().find(options.name)
        if run.done():
            print(f"{run.label} has already ended ({run.state})")
            return
        run.interrupt()
        print(f"interrupt sent to {run.label}")

    def _command_runs(self, options):
        """This session's background runs: a list of their handles that shows as one line each."""
        return self._background_runs().listing()

    def _background_runs(self):  # BackgroundRuns
        return self.session.requests.background

    def _command_debug(self, options) -> None:
        self.session.requests.debug(self._running_pool(), options.rank)

    def _command_plan(self, options):
        """A memory plan (`fsdp2nb.plan_memory`), computed in the kernel: it needs no pool."""
        from fsdp2nb.sizes import parse_size

        world_size, device = plan_ranks(options, self.session.pool)
        capacity = parse_size(options.memory) if options.memory is not None else None
        from fsdp2nb.engine.config import EngineConfig
        from fsdp2nb.engine.memory_plan import plan_memory

        engine = EngineConfig(mixed_precision="fp32" if options.fp32 else "bf16", offload_params=options.offload)
        return plan_memory(options.model, world_size, lora=options.lora, engine=engine, activation_checkpointing=options.ac,
                           batch_size=options.batch, seq_len=options.seq, optimizer=options.optimizer, device=device,
                           capacity_bytes=capacity)

    def _clock_offsets(self, pool: PoolHandle) -> ClockOffsets | None:
        """Ranks on other hosts: their clocks' offsets, measured at the pool's first profile."""
        if not spans_hosts(pool) or pool.state != "ready":
            return None
        if self._clock_pool is not pool:
            self._clock_pool = pool
            self._offsets = estimate_offsets(pool, self.session.requests.next_cell_id, self._profiles)
        return self._offsets

    def _command_profile(self, options):
        """`prof = %fsdp2 profile`: the last profile (of a cell, a block or a background run);
        a profiled cell's that its ranks are still sending is waited for."""
        self._profiles.wait_for_pending()
        self._profiles.take_new()
        if self._profiles.last is None:
            raise UsageMistake("no profile yet: run a cell with `%%fsdp2 --profile`, or `with fsdp2nb.profile():` in one")
        return self._profiles.last

    def _command_stacks(self, options) -> None:
        """Every rank's Python stacks now, all threads, asked of their control threads: a cell runs on."""
        pool = self._running_pool()
        ranks = tuple(range(pool.world_size))
        request_id = self.session.requests.next_cell_id()
        pool.send(ranks, ReportStacks(request_id=request_id), connect_timeout_s=0)
        print(describe_stacks(self._profiles.wait_for_stacks(request_id, ranks, _STACKS_WAIT_S), pool.world_size))

    def _command_dashboard(self, options) -> None:
        self._dashboard().show()

    def _command_metrics(self, options):
        return self._dashboard().metrics_table()

    def _dashboard(self) -> DashboardLink:
        return self.session.dashboard_link()

    def _run_on_ranks(self, command: RankCommand) -> None:
        """Run one of fsdp2nb's commands (worker/commands.py) on every rank, without touching the
        user's names."""
        pool = self._running_pool()
        self.session.requests.run_request(pool, tuple(range(pool.world_size)),
                                          lambda cell_id: RunCommand(cell_id=cell_id, command=command))

    def _running_pool(self) -> PoolHandle:
        with self.session.lifecycle_lock:
            self.session.check_held()
        pool = self.session.pool
        if pool is None or pool.state != "ready":
            raise NoPoolRunning("no pool is running; start one with `%fsdp2 start --cpu N` or a %%fsdp2 cell")
        return pool


def _pickle_for_ranks(values: dict) -> bytes:
    """Pickle notebook values; cloudpickle also carries functions and classes defined in the notebook."""
    import cloudpickle

    try:
        return cloudpickle.dumps(values)
    except Exception:
        pass  # find the culprit (only on failure, so a large push is pickled once)
    for name, value in values.items():
        try:
            cloudpickle.dumps(value)
        except Exception as error:
            raise UsageMistake(f"cannot push {name!r}: it cannot be pickled ({type(error).__name__}: {error}); "
                               "push data (numbers, tensors, dicts), not live objects") from None
    raise UsageMistake(f"cannot push {', '.join(values)}: together they cannot be pickled")
