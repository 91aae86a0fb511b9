"""The options of `%%fsdp2` and `%fsdp2 COMMAND`: parsers built once, option groups shared by every
command that takes them, and what the parsed options mean (a PoolSpec, KeepOptions, ranks)."""

from __future__ import annotations

import argparse
import functools
import shlex

from IPython.core.magic_arguments import MagicArgumentParser

from fsdp2nb.errors import InvalidValue
from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.pool.kept.holder import DEFAULT_KEEP_FOR_S, KeepOptions, default_pool_name, parse_keep_for
from fsdp2nb.pool.spec import HostOptions, PoolSpec, default_spec, spec_from_options

COMMANDS = ("start", "stop", "restart", "status", "push", "pull", "save", "load", "dashboard", "metrics",
            "wait", "interrupt", "runs", "debug", "pools", "attach", "detach", "plan", "profile", "stacks")


def _add_pool_options(parser: argparse.ArgumentParser) -> None:
    """The options that choose a pool, shared by `%%fsdp2`, `start` and `restart`."""
    group = parser.add_argument_group("pool")
    group.add_argument("--gpus", metavar="N|I,J,..", help="N GPUs (the first N visible) or a list of GPU indices")
    group.add_argument("--cpu", type=int, metavar="N", help="N CPU ranks joined by gloo")
    group.add_argument("--timeout", type=float, metavar="SECONDS", help="collective timeout (default 600 s)")
    group.add_argument("--no-dashboard", action="store_true", help="do not show the dashboard when the pool starts")
    hosts = parser.add_argument_group("ranks on several hosts")
    hosts.add_argument("--ray", nargs="?", const="auto", metavar="auto|HOST:PORT",
                       help="hosts from a Ray cluster (default: the one this machine belongs to)")
    hosts.add_argument("--slurm", action="store_true", help="hosts of the Slurm allocation this kernel runs in")
    hosts.add_argument("--nodes", type=int, metavar="N", help="how many hosts (with --slurm: the allocation's)")
    hosts.add_argument("--gpus-per-node", type=int, metavar="N", help="N GPU ranks on each host")
    hosts.add_argument("--cpu-per-node", type=int, metavar="N", help="N CPU ranks on each host")
    hosts.add_argument("--listen", metavar="ADDRESS",
                       help="this host's address on the cluster network (default: found from the route)")


def _add_keep_options(parser: argparse.ArgumentParser, *, with_name: bool) -> None:
    """The options that keep a pool beyond its kernel, shared by `%%fsdp2` and `start`."""
    group = parser.add_argument_group("kept pools")
    group.add_argument("--keep", action="store_true",
                       help="the ranks outlive this kernel; `%fsdp2 attach NAME` in another kernel uses them")
    if with_name:  # on a %%fsdp2 line, --name is shared with --bg (see keep_options)
        group.add_argument("--name", metavar="NAME", help="with --keep: the pool's name (default pool-N)")
    group.add_argument("--keep-for", metavar="DURATION",
                       help="with --keep: unheld and idle this long (90s, 30m, 2h, none), the pool ends (default 1h)")


def keep_options(options, *, cell: bool = False) -> KeepOptions | None:
    """`--keep [--name NAME] [--keep-for DURATION]` as options; None without --keep."""
    if not options.keep:
        if options.keep_for is not None:
            raise InvalidValue("--keep-for applies to a kept pool: add --keep")
        return None
    if cell and options.bg and options.name is not None:
        raise InvalidValue("--name is ambiguous with both --bg and --keep; start the kept pool first "
                           "(`%fsdp2 start --keep --name NAME`), then run the cell with --bg --name")
    keep_for = parse_keep_for(options.keep_for) if options.keep_for is not None else DEFAULT_KEEP_FOR_S
    return KeepOptions(name=options.name or default_pool_name(), keep_for_s=keep_for)


def _parser(prog: str, description: str) -> MagicArgumentParser:
    return MagicArgumentParser(prog=prog, description=description, add_help=False)


@functools.lru_cache(maxsize=64)  # a line that fails raises, so it is not kept
def cell_options(line: str) -> argparse.Namespace:
    """The options of a `%%fsdp2` line; a notebook repeats a few lines, so each is parsed once
    (argparse is a good part of an empty cell's cost). Callers only read the result."""
    return cell_parser().parse_args(split_magic_line(line))


def split_magic_line(line: str) -> list[str]:
    """The words of a magic's line; a trailing `# comment` is not an argument, as in Python."""
    return shlex.split(line, comments=True)


@functools.cache
def cell_parser() -> MagicArgumentParser:
    parser = _parser("%%fsdp2", "Run the cell on every rank of the pool.")
    _add_pool_options(parser)
    parser.add_argument("--ranks", "--rank", metavar="R,..", help="run on these ranks only, e.g. 0 or 0,2 or 1-3")
    parser.add_argument("--bg", action="store_true", help="run in the background: return a handle at once")
    parser.add_argument("--profile", action="store_true",
                        help="profile the cell on every rank; after its output: per-rank times, straggler, timeline")
    parser.add_argument("--name", metavar="NAME",
                        help="with --bg: bind the run's handle to NAME; with --keep: the pool's name")
    _add_keep_options(parser, with_name=False)
    return parser


def line_parsers() -> dict[str, MagicArgumentParser]:
    parsers = {name: _parser(f"%fsdp2 {name}", "") for name in COMMANDS}
    _add_pool_options(parsers["start"])
    _add_keep_options(parsers["start"], with_name=True)
    parsers["attach"].add_argument("name", nargs="?", default=None, metavar="NAME",
                                   help="the kept pool (default: the only one)")
    parsers["attach"].add_argument("--take", action="store_true", help="take it from the kernel that holds it")
    parsers["attach"].add_argument("--no-dashboard", action="store_true", help="do not show the dashboard")
    _add_pool_options(parsers["restart"])
    parsers["push"].add_argument("names", nargs="+", metavar="NAME", help="notebook variables to send to every rank")
    parsers["pull"].add_argument("names", nargs="+", metavar="NAME", help="names on the ranks to pull")
    parsers["pull"].add_argument("--value", action="store_true",
                                 help="return the value (several names: a tuple) instead of defining the names")
    target = parsers["pull"].add_mutually_exclusive_group()
    target.add_argument("--rank", "--ranks", type=int, default=None, help="the rank to pull from (default 0)")
    target.add_argument("--all", action="store_true", help="pull from every rank: a dict rank -> value")
    parsers["save"].add_argument("step", nargs="?", type=_non_negative_int, default=None,
                                 help="step to save as (default: the last step the checkpointer saw)")
    parsers["load"].add_argument("target", nargs="?", default="latest", help="'latest' (default), 'memory' (the snapshot in host memory) or a step")
    parsers["debug"].add_argument("--rank", "--ranks", type=int, default=None,
                                  help="the rank whose last error to open (default: the rank that failed first)")
    _add_plan_options(parsers["plan"])
    for command in ("wait", "interrupt"):
        parsers[command].add_argument("name", nargs="?", default=None, metavar="NAME",
                                      help="the background run's --name (default: the latest run)")
    return parsers


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="PATH_OR_ID", help="a model directory, its config.json, or a cached Hub id")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--gpus", metavar="N|I,J,..", help="N GPU ranks (default: the pool's, else every visible GPU)")
    ranks.add_argument("--cpu", type=int, metavar="N", help="N CPU ranks")
    parser.add_argument("--lora", type=int, metavar="R", help="LoRA adapters of rank R on every Linear but the head")
    # Each long name is plan_memory's parameter, beside the short one.
    parser.add_argument("--batch", "--batch-size", type=int, default=1, metavar="B",
                        help="sequences per rank per step (default 1)")
    parser.add_argument("--seq", "--seq-len", type=int, default=2048, metavar="S", help="tokens per sequence (default 2048)")
    parser.add_argument("--fp32", action="store_true", help="fp32 compute (default: bf16 mixed precision)")
    parser.add_argument("--offload", action="store_true", help="sharded state in host memory (GPU ranks)")
    parser.add_argument("--ac", "--activation-checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--optimizer", default="adamw", metavar="NAME", help="adamw (default), adam, sgd_momentum, sgd")
    parser.add_argument("--memory", "--capacity", metavar="SIZE",
                        help="memory per rank, e.g. 80GiB (default: the GPU's, or the host's)")


def plan_ranks(options, pool: PoolHandle | None) -> tuple[int, str]:
    """(world size, "cuda" or "cpu") for `%fsdp2 plan`: as given, else the running pool's, else the
    default pool's. `--gpus` counts GPUs without needing them here: a plan is for any machine."""
    if options.cpu is not None:
        return options.cpu, "cpu"
    if options.gpus is not None:
        parts = [part.strip() for part in options.gpus.split(",") if part.strip()]
        if not parts or not all(part.isdigit() for part in parts):
            raise InvalidValue(f"--gpus {options.gpus!r} is neither a count (8) nor a list of indices (0,2,3)")
        return (int(parts[0]) if "," not in options.gpus else len(parts)), "cuda"
    spec = pool.spec if pool is not None else default_spec()
    return spec.world_size, "cuda" if spec.devices[0].startswith("cuda") else "cpu"


def _non_negative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"STEP must be a whole number >= 0, got {text!r}")
    return int(text)


def spec_or_none(options) -> PoolSpec | None:
    hosts = HostOptions(ray=options.ray, slurm=options.slurm, num_nodes=options.nodes,
                        gpus_per_node=options.gpus_per_node, cpu_per_node=options.cpu_per_node, listen=options.listen)
    if options.gpus is None and options.cpu is None and options.timeout is None and not hosts.given:
        return None
    return spec_from_options(gpus=options.gpus, cpu=options.cpu, collective_timeout_s=options.timeout, hosts=hosts)
