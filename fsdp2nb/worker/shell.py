"""The IPython shell each rank runs cells in, with display and tracebacks sent to the notebook.

Using a real InteractiveShell means a cell behaves as in a notebook: magics and `!` work, the
last expression is displayed, `display()` publishes rich output, and tracebacks are IPython's.
"""

from __future__ import annotations

import ast
import bdb
import functools
import linecache
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator

from IPython.core.compilerop import CachingCompiler
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from traitlets import TraitError
from traitlets.config import Config

from fsdp2nb.host.sigint import SigintGate
from fsdp2nb.wire.events import RichKind
from fsdp2nb.wire.records import ErrorInfo, ErrorKind
from fsdp2nb.worker.error_kinds import error_kind
from fsdp2nb.worker.memory_failure import shortage_of
from fsdp2nb.worker.stdin import InputUnavailable, InterruptedAtPrompt

RichSink = Callable[[RichKind, dict, dict], None]


def _discard(kind: RichKind, data: dict, metadata: dict) -> None:
    pass


class _RankDisplayHook(DisplayHook):
    """Sends the cell's last expression as an execute result instead of printing `Out[n]:`."""

    sink: RichSink = staticmethod(_discard)
    quiet_cell = False
    """The running cell ends with `;`: show no result (IPython reads this from its history)."""

    def quiet(self) -> bool:
        return self.quiet_cell

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict, md_dict=None) -> None:
        self.sink("result", format_dict, md_dict or {})

    def finish_displayhook(self) -> None:
        pass

    def log_output(self, format_dict) -> None:
        """Keep no record of the value. IPython adds each cell's shown value to its history's
        `outputs` (one entry per cell, never dropped, even with the history disabled); a rank's
        values are shown in the notebook, which keeps them, and nothing on a rank reads them back."""


class _RankDisplayPublisher(DisplayPublisher):
    """Sends `display()` and `clear_output()` to the notebook."""

    sink: RichSink = staticmethod(_discard)

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        self.sink("display", data, metadata or {})

    def clear_output(self, wait: bool = False) -> None:
        self.sink("clear", {"wait": wait}, {})


class _RankCompiler(CachingCompiler):
    """IPython's compiler, naming cells as it does, with the hash of a cell run before reused,
    and keeping a cell's source only while something can show it.

    A cell's name carries a hash of its source. A notebook runs the same cells again and again
    (a training step), and hashing the source is a visible part of an empty cell's cost on a
    rank whose caches went cold.

    IPython puts every cell's source in `linecache` under the cell's name (its number in it) and
    never removes it: a day of cells would keep them all. A traceback, the debugger or the
    activity sampler can only show lines of code that still exists, so the rank keeps a cell's
    source while a code object compiled from it lives (the cell running, a function it defined,
    a traceback's frames, the compiled-cell cache) or while it is one of the last
    `KEPT_RECENT_CELLS` cells (a syntax error has no code); the source of every other cell is
    dropped, which bounds what the rank holds by the code that lives, not by the cells run. (A
    cell whose traceback IPython drew stays while IPython's traceback formatting, through the
    `executing` package's cache, keeps that cell's code.)"""

    _MAX_NAMED = 32
    _PROBE = 918273645  # a cell number that shows where IPython puts the number in a name
    KEPT_RECENT_CELLS = 8

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[str, tuple[str, str] | None] = {}  # source -> the name around its number
        self._recent: deque[str] = deque()  # the names of the last cells cached, oldest first
        self._live_code: dict[str, set[weakref.ref]] = {}  # cell name -> its code objects alive
        # Reentrant: a code object freed while the lock is held (by a dict's old value going)
        # runs its weakref callback on the same thread.
        self._lock = threading.RLock()

    def cache(self, transformed_code: str, number: int = 0, raw_code: str | None = None) -> str:
        name = super().cache(transformed_code, number, raw_code)
        with self._lock:
            if name in self._recent:
                self._recent.remove(name)
            self._recent.append(name)
            while len(self._recent) > self.KEPT_RECENT_CELLS:
                self._drop_if_unused(self._recent.popleft())
        return name

    def __call__(self, source, filename, symbol, **kwargs) -> types.CodeType:
        code = super().__call__(source, filename, symbol, **kwargs)
        self.keep_source_while_alive(filename, [code])
        return code

    def keep_source_while_alive(self, name: str, blocks: list[types.CodeType]) -> None:
        """Keep the source cached under `name` while any of `blocks`, or code nested in them
        (functions, classes, comprehensions), lives. Names this compiler did not cache (code
        compiled by `%time`, say) are left alone."""
        with self._lock:
            if name not in linecache.cache or name not in self._filename_map:
                return
            refs = self._live_code.setdefault(name, set())
            freed = functools.partial(self._code_freed, name)
            refs.update(weakref.ref(code, freed) for code in _code_objects(blocks))

    def _code_freed(self, name: str, ref: weakref.ref) -> None:
        with self._lock:
            refs = self._live_code.get(name)
            if refs is not None:
                refs.discard(ref)
            if name not in self._recent:
                self._drop_if_unused(name)

    def _drop_if_unused(self, name: str) -> None:
        if self._live_code.get(name):
            return
        self._live_code.pop(name, None)
        linecache.cache.pop(name, None)
        self._filename_map.pop(name, None)

    def get_code_name(self, raw_code: str, transformed_code: str, number: int) -> str:
        parts = self._names.get(transformed_code, ())
        if parts == ():
            if len(self._names) >= self._MAX_NAMED:
                self._names.pop(next(iter(self._names)))
            probe = super().get_code_name(raw_code, transformed_code, self._PROBE)
            head, found, tail = probe.partition(str(self._PROBE))
            parts = self._names[transformed_code] = (head, tail) if found else None
        if parts is None:  # a naming this class does not know: leave it to IPython every time
            return super().get_code_name(raw_code, transformed_code, number)
        return f"{parts[0]}{number}{parts[1]}"


_SIGINT_HANDLER_CODES = frozenset((SigintGate.__call__.__code__, SigintGate.__exit__.__code__))
"""Where the rank's SIGINT handling raises KeyboardInterrupt from: on top of the user's frames,
as a plain cell's (C-level) handler is not."""


class RankShell(InteractiveShell):
    """An InteractiveShell that records the last exception instead of printing it."""

    last_error: ErrorInfo | None = None
    released_error: BaseException | None = None
    """The last error of a collective the kernel released, until the groups are re-formed
    (`reformable_groups` clears its frames then); IPython keeps no other error of that kind."""

    def showtraceback(self, exc_tuple=None, *args, **kwargs) -> None:
        """IPython's, without the frames of the rank's own SIGINT handling: an interrupted cell
        shows the user's line where it stopped, as a plain cell does (also where the interrupt
        is the cause or context of another error)."""
        error, seen = (exc_tuple or sys.exc_info())[1], set()
        if isinstance(error, BaseException) and _kind_of(error) == "released":
            # The kernel released this collective and shows one line for it: formatting a deep
            # FSDP2 stack would only delay the pool's recovery.
            self.last_error = ErrorInfo(ename=type(error).__name__, evalue=str(error), traceback=(), kind="released")
            self.released_error = error
            return
        while isinstance(error, BaseException) and id(error) not in seen:
            seen.add(id(error))
            if isinstance(error, KeyboardInterrupt):
                _cut_traceback(error.__traceback__, lambda code: code in _SIGINT_HANDLER_CODES)
            elif isinstance(error, (InterruptedAtPrompt, InputUnavailable)):  # from a prompt inside pdb
                _cut_traceback(error.__traceback__, lambda code: code.co_filename == bdb.__file__)
            error = error.__cause__ or error.__context__
        super().showtraceback(exc_tuple, *args, **kwargs)

    def _showtraceback(self, etype, evalue, stb: list[str]) -> None:
        ename = getattr(etype, "__name__", str(etype))
        if ename == "InterruptedAtPrompt":  # the stop button, as any other cell's
            ename = "KeyboardInterrupt"
        mistake = _one_line_mistake(evalue) if isinstance(evalue, BaseException) else None
        kind = _kind_of(evalue)
        if mistake is not None:  # said in one line: the traceback would only bury it
            self.last_error = ErrorInfo(ename=ename, evalue=mistake, traceback=(), kind=kind)
            return
        self.last_error = ErrorInfo(ename=ename, evalue=str(evalue), traceback=tuple(stb), kind=kind,
                                    memory=shortage_of(evalue) if isinstance(evalue, BaseException) else None)


def _kind_of(error: object) -> ErrorKind:
    if not isinstance(error, BaseException):
        return "raised"
    if isinstance(error, InterruptedAtPrompt):
        return "interrupted"
    from fsdp2nb.worker.reformable_groups import was_released

    return error_kind(error, released=was_released())


def _one_line_mistake(error: BaseException) -> str | None:
    """The one line for an error that says all there is to say, or None: bad input to
    `fsdp2nb.generate` / `fsdp2nb.evaluate`, a mesh the engine cannot shard over, or a Trainer
    given a model it cannot train."""
    inference = sys.modules.get("fsdp2nb.engine.inference")
    if inference is not None and isinstance(error, inference.InferenceInputError):
        return str(error)
    mesh = sys.modules.get("fsdp2nb.engine.mesh")
    if mesh is not None and isinstance(error, mesh.InvalidMesh):
        return str(error)
    return _wrong_trainer_class(error)


def _wrong_trainer_class(error: BaseException) -> str | None:
    """The one line for a Hugging Face Trainer handed a model it cannot train as sharded, or None.

    A plain transformers.Trainer given a `load_model` model wraps it in DDP, which fails deep in
    DTensor code with a message that names neither. The engine is asked only about errors raised
    by it or passing through DDP's constructor, so other cells' errors import nothing more."""
    hf_trainer = sys.modules.get("fsdp2nb.engine.hf_trainer")
    if hf_trainer is not None and isinstance(error, hf_trainer.WrongTrainerClass):
        return str(error)
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is None:
        return None
    ddp_init, entry = ddp.DistributedDataParallel.__init__.__code__, error.__traceback__
    while entry is not None and entry.tb_frame.f_code is not ddp_init:
        entry = entry.tb_next
    if entry is None:
        return None
    from fsdp2nb.engine.hf_trainer import WRAPPED_IN_DDP, is_fsdp2_model_wrapped_in_ddp

    return WRAPPED_IN_DDP if is_fsdp2_model_wrapped_in_ddp(error) else None


def _cut_traceback(traceback: types.TracebackType | None, internal: Callable[[types.CodeType], bool]) -> None:
    """Drop the entries of `traceback` from the first `internal` frame on: the rank's SIGINT
    handler, or the debugger a prompt was in. Entries run outermost first, and those frames sit
    on top of the user's frame they stopped, where a plain cell's traceback ends."""
    entry = traceback
    while entry is not None and entry.tb_next is not None:
        if internal(entry.tb_next.tb_frame.f_code):
            entry.tb_next = None
            return
        entry = entry.tb_next


def make_shell(namespace: dict, sink: RichSink) -> RankShell:
    """A shell whose user namespace starts with `namespace` and whose displays go to `sink`."""
    config = Config()
    # N ranks writing one SQLite history file would contend on its lock for nothing.
    config.HistoryManager.enabled = False
    # instance(): display() and get_ipython() find only the registered singleton.
    shell = RankShell.instance(
        config=config, user_ns=namespace, displayhook_class=_RankDisplayHook,
        display_pub_class=_RankDisplayPublisher, compiler_class=_RankCompiler, colors="neutral",
    )
    shell.displayhook.sink = sink
    shell.display_pub.sink = sink
    shell.events.register("post_run_cell", _flush_matplotlib_figures)
    # A rank runs nothing but cells: its builtins (get_ipython, exit) and sys.displayhook are set
    # once for good, where IPython sets and restores them around every cell.
    shell.builtin_trap.__enter__()
    shell.display_trap.__enter__()
    return shell


def run_cell(shell: RankShell, code: str, transformed: str | None = None,
             execution_count: int | None = None, color_scheme: str | None = None) -> ErrorInfo | None:
    """Run one cell; the error it raised, if any.

    `transformed` is the cell after IPython's input transformations, done once in the notebook
    kernel for all ranks. Such a cell runs on a short path (`_run_transformed`); cells with
    top-level `await` take IPython's full `run_cell`. The notebook keeps the history: ranks
    number cells with the notebook's count, so a traceback's `In[N]` is the notebook cell's,
    and colour tracebacks with the notebook's `color_scheme`.
    """
    shell.last_error = None
    if color_scheme is not None and color_scheme != shell.colors:
        _use_color_scheme(shell, color_scheme)
    if execution_count is not None and execution_count != shell.execution_count:
        shell.execution_count = execution_count  # a trait: setting it notifies observers
    shell.displayhook.quiet_cell = _ends_with_semicolon(transformed or code)
    if transformed is None or _may_await(shell, code, transformed):
        result = shell.run_cell(code, store_history=False)
    else:
        result = _run_transformed(shell, code, transformed)
    if result.success:
        return None
    if isinstance(result.error_in_exec, bdb.BdbQuit):  # IPython ends the cell quietly; so does the rank
        return ErrorInfo(ename="BdbQuit", evalue="quit the debugger (q), which ends the cell", traceback=())
    return shell.last_error or ErrorInfo(ename="Error", evalue="the cell failed", traceback=())


def post_mortem(shell: RankShell, rank: int) -> ErrorInfo | None:
    """IPython's debugger at the frame where the rank's last failed cell raised, as `%debug`
    opens it; the error to report if there is nothing to debug."""
    if getattr(sys, "last_traceback", None) is None:
        return ErrorInfo(ename="NothingToDebug", traceback=(),
                         evalue=f"rank {rank} has no error to debug: no cell has failed on it")
    shell.last_error = None
    try:
        shell.debugger(force=True)
    except bdb.BdbQuit:
        pass
    return shell.last_error


def _use_color_scheme(shell: RankShell, scheme: str) -> None:
    """Colour tracebacks as the notebook does. A scheme this rank does not know (a theme
    registered in the kernel only) leaves the rank's own."""
    try:
        from IPython.utils.PyColorize import theme_table  # IPython 9: schemes are named themes
    except ImportError:
        theme_table = None
    if theme_table is not None and scheme not in theme_table:
        return
    try:
        shell.colors = scheme
    except TraitError:  # IPython 8 refuses an unknown name before using it
        pass


def _ends_with_semicolon(source: str) -> bool:
    # Only a `;` on the last line can end the cell; tokenizing is needed to tell it from one
    # in a string or a comment, and is skipped otherwise.
    return ";" in source.rstrip().rpartition("\n")[2] and DisplayHook.semicolon_at_end_of_expression(source)


def _may_await(shell: RankShell, code: str, transformed: str) -> bool:
    # Top-level await needs one of these words; checking for them spares a compile per cell.
    if "await" not in transformed and "async" not in transformed:
        return False
    return shell.should_run_async(code, transformed_cell=transformed, preprocessing_exc_tuple=None)


def _run_transformed(shell: RankShell, code: str, transformed: str) -> ExecutionResult:
    """IPython's cell semantics without its per-cell bookkeeping (history, async machinery,
    traits), which a rank would otherwise pay for on every cell.

    Kept: the pre/post events, user AST transformers, source cached for tracebacks, the last
    expression shown through the display hook (installed for good by make_shell, with the
    builtins), and IPython's own `run_code` (its exception handling and tracebacks).
    """
    info = ExecutionInfo(raw_cell=code, store_history=False, silent=False, shell_futures=True, cell_id=None)
    result = ExecutionResult(info)
    shell.events.trigger("pre_execute")
    shell.events.trigger("pre_run_cell", info)
    try:
        blocks = _compile_cell(shell, code, transformed)
    except (SyntaxError, OverflowError, ValueError) as error:  # what compile() raises for bad source
        shell.showsyntaxerror()
        result.error_before_exec = error
    else:
        for block in blocks:
            if _run_synchronously(shell.run_code(block, result)):
                break  # run_code returns True when the block raised
    shell.events.trigger("post_execute")
    shell.events.trigger("post_run_cell", result)
    return result


def _compile_cell(shell: RankShell, code: str, transformed: str) -> list:
    """Code objects for the cell: its statements, then its last expression in 'single' mode
    (which calls the display hook with the value), as IPython's 'last_expr' interactivity.

    A cell run again unchanged (a training cell, say) reuses its code objects under the new
    cell's name, unless user AST transformers could make the result differ."""
    cell_name = shell.compile.cache(transformed, shell.execution_count, raw_code=code)
    key = (transformed, shell.compile.flags)
    cached = None if shell.ast_transformers else _compiled_cells.get(key)
    if cached is not None:
        renamed = [_renamed(block, cell_name) for block in cached]
        shell.compile.keep_source_while_alive(cell_name, renamed)
        return renamed
    blocks = _compile_blocks(shell, transformed, cell_name)
    if not shell.ast_transformers:
        if len(_compiled_cells) >= _MAX_COMPILED_CELLS:
            _compiled_cells.pop(next(iter(_compiled_cells)))
        _compiled_cells[key] = blocks
    return blocks


_MAX_COMPILED_CELLS = 32
_compiled_cells: dict[tuple[str, int], list[types.CodeType]] = {}


def _code_objects(blocks: list[types.CodeType]) -> Iterator[types.CodeType]:
    """`blocks` and every code object nested in them."""
    for code in blocks:
        yield code
        yield from _code_objects([c for c in code.co_consts if isinstance(c, types.CodeType)])


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` and the code objects nested in it (functions, classes), under another file name:
    tracebacks find a cell's source by the name its code carries."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _compile_blocks(shell: RankShell, transformed: str, cell_name: str) -> list[types.CodeType]:
    tree = shell.transform_ast(shell.compile.ast_parse(transformed, filename=cell_name))
    body = tree.body
    last = [body.pop()] if body and isinstance(body[-1], ast.Expr) else []
    blocks = []
    if body:
        blocks.append(shell.compile(ast.Module(body=body, type_ignores=[]), cell_name, "exec"))
    if last:
        blocks.append(shell.compile(ast.Interactive(body=last), cell_name, "single"))
    return blocks


def _run_synchronously(coroutine):
    """Run a coroutine that never suspends (should_run_async said so) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a cell that should not await suspended")  # internal: an invariant of the shell's own coroutine runner


def _flush_matplotlib_figures(result=None) -> None:
    """Show figures a cell drew but did not show, as the inline backend does in a notebook."""
    if "matplotlib.pyplot" not in sys.modules:
        return
    try:
        from matplotlib_inline.backend_inline import flush_figures
    except ImportError:
        return
    flush_figures()
