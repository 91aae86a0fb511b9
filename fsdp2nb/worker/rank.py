"""One rank of a pool: joins the process group, then runs the notebook's requests until told to stop.

This module is the rank's request loop (reading requests, running them, replying, interrupts);
what it sets up once before the first request is in rank_setup.py.

Threads in a rank:
- main: reads requests and runs cells (user code must run on the main thread to receive
  KeyboardInterrupt);
- control: reads the requests that must act while a cell runs (interrupts, save requests);
- two capture threads (stdout, stderr) and the resource sampler, which only send events.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback

from fsdp2nb.checkpoint.requests import process_failures
from fsdp2nb.checkpoint.tracking import current_checkpointer
from fsdp2nb.errors import UnknownRequest
from fsdp2nb.host.process_identity import own_process_key
from fsdp2nb.host.rank_logs import RotatingLog, rank_log_path
from fsdp2nb.host.sigint import SigintGate, sigint_deferred
from fsdp2nb.pool.kept.directory import ActivitySlot, host_kept_dir
from fsdp2nb.pool.kept.keeper import RankFollower
from fsdp2nb.wire.channels import RankChannels
from fsdp2nb.wire.events import CellFinished, RankClock, RankReady, RichKind, RichOutput, StreamOutput
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
from fsdp2nb.wire.records import ErrorInfo
from fsdp2nb.wire.requests import (
    AnswerInput,
    Interrupt,
    PostMortem,
    PullValue,
    PushValues,
    ReleaseCollectives,
    ReportActivity,
    ReportClock,
    ReportStacks,
    RequestSave,
    ResetPeak,
    RunCell,
    RunCommand,
    Shutdown,
)
from fsdp2nb.wire.signing import Signer
from fsdp2nb.worker.capture import OutputSync, line_buffered_streams
from fsdp2nb.worker.error_kinds import error_kind
from fsdp2nb.worker.profiling import recording, send_after_reply
from fsdp2nb.worker.rank_setup import (
    capture_output,
    join_process_group,
    run_as_batch_work,
    start_reporters,
    torchrun_environment,
)
from fsdp2nb.worker.rendezvous import network_environment
from fsdp2nb.worker.stdin import NotebookStdin

_BLOCK = -1
"""Wait for a message without a timeout: a rank whose loops woke to poll would steal a core
from training ranks on a host with no core spare; EOF ends the wait once the kernel is gone."""
_REQUESTS = (RunCell, PushValues, PullValue, RunCommand, PostMortem)
"""What the requests channel carries, besides Shutdown."""


class Rank:
    """A rank's state and request loop; `serve()` returns when the kernel sends Shutdown."""

    def __init__(self, plan: LaunchPlan, rank_plan: RankPlan, key: bytes,
                 pipes: dict[int, tuple[int, int]] | None = None, wake_fd: int | None = None) -> None:
        self.plan = plan
        self.rank = rank_plan.rank
        self.device = rank_plan.device
        self.log_path = rank_log_path(plan.log_dir, self.rank)
        self._cell_id: int | None = None
        self._interrupted_cell_id: int | None = None
        self._in_request = False
        self._main_thread_id = threading.get_ident()
        self._channels = RankChannels(Signer(key), plan.address, rank=self.rank, fingerprint=plan.tls_fingerprint,
                                      kept=bool(plan.kept_dir))
        self._activity: ActivitySlot | None = None
        self._follower: RankFollower | None = None
        if plan.kept_dir:  # a kept pool: outlive the kernel, follow the next one (pool/kept/keeper.py)
            assert wake_fd is not None, "the agent gives every rank of a kept pool a wake pipe"
            directory = host_kept_dir(plan.kept_dir, rank_plan.node, plan.multi_host)
            self._activity = ActivitySlot(directory, self.rank)
            self._follower = RankFollower(self._channels, Signer(key), directory, wake_fd, self._rejoin)
        self._held_reply: list[RichOutput | CellFinished] = []
        """A kept rank's reply to its last request (with the request's results) that found no
        kernel to go to: sent to the next kernel that attaches (`_rejoin`)."""
        self._reply_lock = threading.Lock()
        os.environ.update(network_environment(plan, rank_plan, self._channels.local_host()))
        self._log = RotatingLog(self.log_path)  # lives as long as the rank
        self._captures = capture_output(self._send_stream, self._log, pipes or {})
        self._output_sync = OutputSync(self._captures.values(), line_buffered_streams())
        self._stdin = NotebookStdin(self.rank, self._channels.send_event, lambda: self._cell_id, self._output_sync.sync,
                                    on_waiting=self._activity.waiting_for_input if self._activity else None)
        signal.signal(signal.SIGINT, SigintGate(self._on_sigint))

    # --- start-up -----------------------------------------------------------------------------

    def start(self) -> None:
        namespace = join_process_group(self.plan, self.rank, self.device, self._channels)
        from fsdp2nb.worker.shell import make_shell, run_cell

        self.shell = make_shell(namespace, self._send_rich)
        self._stdin.install()  # after IPython's import, which reads sys.stdin's encoding
        self._run_cell = run_cell  # imported once: the shell module needs IPython, loaded only now
        self._sampler, self._profile_sink = start_reporters(self.rank, self.device, self._channels.send_event,
                                                            lambda: self._cell_id, trace_dir=self.plan.log_dir)
        threading.Thread(target=self._control_loop, daemon=True, name="fsdp2nb-control").start()
        self._channels.send_event(self._ready_event())

    def _ready_event(self, held_reply: int | None = None) -> RankReady:
        """Sent when the rank joined the pool, and again to each kernel that attaches a kept pool."""
        pid, started = own_process_key()
        return RankReady(
            rank=self.rank, pid=pid, start_time=started, device=self.device,
            hostname=socket.gethostname(), log_path=self.log_path, address=self._channels.local_host() or "",
            held_reply=held_reply,
        )

    def _rejoin(self) -> None:
        """A kept pool's rank reconnected to a kernel that attached (on the control thread): say
        so, then hand it the reply and the prompt that no kernel received."""
        with self._reply_lock:
            held, self._held_reply = self._held_reply, []
            self._channels.send_event(self._ready_event(held_reply=held[-1].cell_id if held else None))
            for event in held:
                self._send_reply_locked(event)
        self._stdin.ask_again()

    def _send_reply(self, event: RichOutput | CellFinished) -> None:
        """A request's result or its end; a kept rank keeps what finds no kernel, for the next one."""
        with self._reply_lock:
            self._send_reply_locked(event)

    def _send_reply_locked(self, event: RichOutput | CellFinished) -> None:
        try:
            sent = self._channels.send_event(event)
        except OSError:  # the kernel is gone: the request loop finds so next (see `serve`)
            return
        if not sent and self._follower is not None:
            self._held_reply.append(event)

    # --- request loop -------------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            generation = self._channels.generation
            try:
                request = self._channels.receive_request(_BLOCK)
            except (EOFError, OSError):
                # The kernel is gone. A kept pool waits for the next one (the control thread
                # reconnects); any other rank writes its newest snapshot to disk, then exits.
                if self._follower is None:
                    from fsdp2nb.checkpoint.persist_on_exit import persist_at_kernel_exit

                    self._sampler.stop()  # its readings have no kernel to go to
                    persist_at_kernel_exit(self.rank)
                if self._follower is None or not self._channels.wait_for_reconnect(generation):
                    return
                continue
            if request is None:
                continue
            if isinstance(request, Shutdown):
                self._finish_background_work()
                return
            if not isinstance(request, _REQUESTS):
                self._refuse(request)
                continue
            if self._activity is not None:
                self._activity.started(request.cell_id, getattr(request, "execution_count", None))
                with self._reply_lock:  # a kernel sent this, so the one before got the held reply
                    self._held_reply.clear()
            finished = self._run_request(request)
            with sigint_deferred():  # an interrupt now has nothing left to interrupt
                self._output_sync.sync()
                self._cell_id = None
                if self._activity is not None:  # before the reply: see NotebookSession._resume_run
                    self._activity.ended()
                self._sampler.flush()  # what the request logged or began tracking goes before its reply
                self._send_reply(finished)
                send_after_reply()  # a profiled cell's: the cell ended at its reply; the next request waits
            self._sampler.refresh_tracked_sizes()  # here, not on the sampler's thread: see TrackedSizes

    def _run_request(self, request: RunCell | PushValues | PullValue | RunCommand | PostMortem) -> CellFinished:
        """Run one request; KeyboardInterrupt is raised only while this runs (see _on_sigint)."""
        self._cell_id = request.cell_id
        try:
            self._in_request = True
            if request.cell_id == self._interrupted_cell_id:
                raise KeyboardInterrupt  # the interrupt overtook the request
            return self._handle(request)
        except KeyboardInterrupt:  # arrived outside the user's code, e.g. before it started
            self._in_request = False
            return self._failure(request.cell_id, _interrupted())
        except Exception as exc:  # outside IPython's handling (a push that cannot be unpickled, an
            # AST transformer rejecting the cell): the request fails, the rank and its state live on
            from fsdp2nb.worker.reformable_groups import was_released

            return self._failure(request.cell_id, ErrorInfo(
                ename=type(exc).__name__, evalue=str(exc), traceback=tuple(traceback.format_exception(exc)),
                kind=error_kind(exc, released=was_released())))
        finally:
            self._in_request = False

    def _say_failed_save(self) -> None:
        """A background save that failed and that no cell raised says so at this cell's end: the
        cell after the one that started it, or a later one if the save was still writing."""
        notice = process_failures().take()
        if notice is not None and self.rank == 0:  # every rank's save failed alike; one line
            print(notice, file=sys.stderr, flush=True)

    def _finish_background_work(self) -> None:
        """Before exiting, let an asynchronous checkpoint save finish (os._exit would cut it off)."""
        checkpointer = current_checkpointer()
        if checkpointer is None:
            return
        try:
            checkpointer.wait()
        except Exception as error:  # the save failed; say so in the rank's log, then exit anyway
            print(f"rank {self.rank}: the last checkpoint save failed: {error}", file=sys.stderr)

    def _handle(self, request: RunCell | PushValues | PullValue | RunCommand | PostMortem) -> CellFinished:
        if isinstance(request, RunCell):
            with recording(self._profile_sink, request.profile, after_reply=True):
                error = self._run_cell(self.shell, request.code, request.transformed, request.execution_count,
                                       request.color_scheme)
            self._say_failed_save()
            return self._failure(request.cell_id, error) if error else self._success(request.cell_id)
        if isinstance(request, PostMortem):
            from fsdp2nb.worker.shell import post_mortem

            error = post_mortem(self.shell, self.rank)
            return self._failure(request.cell_id, error) if error else self._success(request.cell_id)
        if isinstance(request, PushValues):
            return self._push(request)
        if isinstance(request, RunCommand):
            return self._run_command(request)
        if isinstance(request, PullValue):
            return self._pull(request)
        raise _unknown(request)

    def _refuse(self, message: object) -> None:
        """A message that is no request of this channel (a bug, or a kernel of another fsdp2nb):
        its request fails, saying so, where it names one; the rank and its state live on."""
        error = _unknown(message)
        cell_id = getattr(message, "cell_id", None)
        if isinstance(cell_id, int):
            self._send_reply(self._failure(cell_id, ErrorInfo(ename=type(error).__name__, evalue=str(error),
                                                              traceback=())))
        else:
            print(f"fsdp2nb: rank {self.rank} ignored a message: {error}", file=sys.stderr, flush=True)

    def _run_command(self, request: RunCommand) -> CellFinished:
        """One of fsdp2nb's commands; an error (an interrupt included) comes with IPython's
        traceback, as a cell's does."""
        from fsdp2nb.worker.commands import run_command

        try:
            run_command(request.command)
        except (Exception, KeyboardInterrupt):
            self.shell.last_error = None
            self.shell.showtraceback()
            error = self.shell.last_error or ErrorInfo(ename="Error", evalue="the command failed", traceback=())
            return self._failure(request.cell_id, error)
        return self._success(request.cell_id)

    def _push(self, request: PushValues) -> CellFinished:
        self.shell.user_ns.update(pickle.loads(request.payload))  # verified by the transport already
        return self._success(request.cell_id)

    def _pull(self, request: PullValue) -> CellFinished:
        from fsdp2nb.worker.pulled_values import value_for_notebook

        # Every rank takes part, defined or not: a DTensor's pieces are gathered from all.
        try:
            value = value_for_notebook(self.shell.user_ns.get(request.name), request.reply_ranks)
        except ValueError as exc:
            return self._failure(request.cell_id, ErrorInfo(ename="ValueError", traceback=(),
                                                            evalue=f"cannot pull {request.name!r}: {exc}"))
        if request.name not in self.shell.user_ns:
            error = ErrorInfo(ename="NameError", evalue=f"name {request.name!r} is not defined on rank {self.rank}",
                              traceback=())
            return self._failure(request.cell_id, error)
        if self.rank not in request.reply_ranks:
            return self._success(request.cell_id)
        try:
            import cloudpickle

            payload = cloudpickle.dumps(value)
        except Exception as exc:
            error = ErrorInfo(ename=type(exc).__name__,
                              evalue=f"{request.name!r} cannot be sent to the notebook: {exc}", traceback=())
            return self._failure(request.cell_id, error)
        return CellFinished(rank=self.rank, cell_id=request.cell_id, status="ok", value=payload)

    def _success(self, cell_id: int) -> CellFinished:
        return CellFinished(rank=self.rank, cell_id=cell_id, status="ok")

    def _failure(self, cell_id: int, error: ErrorInfo) -> CellFinished:
        return CellFinished(rank=self.rank, cell_id=cell_id, status="error", error=error)

    def _control_loop(self) -> None:
        while True:
            try:
                if self._follower is not None:
                    message = self._follower.receive_control()
                else:
                    message = self._channels.receive_control(_BLOCK)
            except (EOFError, OSError):
                cell_id = self._cell_id
                if self._follower is None and cell_id is not None:
                    self._interrupt(cell_id)  # the kernel is gone: end its cell, so the main thread persists
                return
            if message is None:
                continue
            try:
                self._on_control(message)
            except Exception as error:  # keep serving interrupts whatever one message did
                print(f"rank {self.rank}: control request {message!r} failed: {error}", file=sys.stderr)

    def _on_control(self, message) -> None:
        if isinstance(message, Interrupt):
            self._interrupt(message.cell_id)
        elif isinstance(message, ReleaseCollectives):
            from fsdp2nb.worker.reformable_groups import release_collectives

            release_collectives(message.release_id)
        elif isinstance(message, RequestSave):
            from fsdp2nb.checkpoint.requests import post_save_request

            post_save_request(message.request_id)
        elif isinstance(message, ResetPeak):
            self._sampler.reset_peak()
        elif isinstance(message, ReportActivity):
            self._report_activity()
        elif isinstance(message, ReportClock):
            self._channels.send_event(RankClock(rank=self.rank, request_id=message.request_id, unix_ns=time.time_ns()))
        elif isinstance(message, ReportStacks):
            from fsdp2nb.worker.stacks import rank_stacks

            self._channels.send_event(rank_stacks(self.rank, message.request_id, self._cell_id, self._main_thread_id))
        elif isinstance(message, AnswerInput):
            self._stdin.deliver(message)

    def _report_activity(self) -> None:
        from fsdp2nb.worker.activity import sample_activity

        # A CPU pool's groups count the collectives they enter (worker/reformable_groups.py).
        self._channels.send_event(sample_activity(self.rank, self._cell_id, self._main_thread_id,
                                                  counts_collectives=self.plan.backend == "gloo"))

    def _interrupt(self, cell_id: int) -> None:
        from fsdp2nb.checkpoint.requests import process_stops

        self._interrupted_cell_id = cell_id
        if self._cell_id != cell_id or self._stdin.interrupt(cell_id):  # at a prompt it ends there
            return
        if not process_stops().post():  # a Trainer with fsdp2nb.TrainerCallback stops at its next step
            signal.pthread_kill(self._main_thread_id, signal.SIGINT)

    def _on_sigint(self, signum, frame) -> None:
        # Only a running request is interrupted: a SIGINT between cells, or while the reply is
        # being sent, is ignored rather than allowed to kill the rank or tear a frame.
        if self._in_request:
            raise KeyboardInterrupt

    # --- output -------------------------------------------------------------------------------

    def _send_stream(self, stream: str, text: str) -> None:
        self._channels.send_event(StreamOutput(rank=self.rank, cell_id=self._cell_id, stream=stream, text=text))

    def _send_rich(self, kind: RichKind, data: dict, metadata: dict) -> None:
        self._output_sync.sync()  # text printed before a display must reach the notebook first
        output = RichOutput(rank=self.rank, cell_id=self._cell_id, kind=kind, data=data, metadata=metadata)
        if kind == "result":  # a kept pool's next kernel shows it with the reply
            self._send_reply(output)
        else:
            self._channels.send_event(output)

    def close(self) -> None:
        self._sampler.stop()
        self._channels.close()


def _interrupted() -> ErrorInfo:
    return ErrorInfo(ename="KeyboardInterrupt", evalue="", traceback=("KeyboardInterrupt",), kind="interrupted")


def run_rank(plan: LaunchPlan, rank_plan: RankPlan, key: bytes,
             pipes: dict[int, tuple[int, int]] | None = None, wake_fd: int | None = None) -> None:
    """Entry point of a rank process; returns when the pool shuts it down."""
    run_as_batch_work()
    os.environ.update(torchrun_environment(plan, rank_plan))
    rank = Rank(plan, rank_plan, key, pipes, wake_fd)
    # A crash in C code (SIGSEGV, SIGABRT) ends the rank before any Python handler runs: have it
    # write the crashing thread's stack to fd 2, now the rank's captured stderr, which the agent
    # drains into the rank's log and the cell's exit report.
    faulthandler.enable(file=sys.__stderr__, all_threads=False)
    rank.start()
    try:
        rank.serve()
    finally:
        rank.close()


def _unknown(message: object) -> UnknownRequest:
    return UnknownRequest(f"{type(message).__name__} is not a request a rank runs; it runs "
                          f"{', '.join(cls.__name__ for cls in _REQUESTS)}")
