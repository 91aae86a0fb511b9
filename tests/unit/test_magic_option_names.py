"""Option names a PyTorch user guesses: `%fsdp2 plan` takes plan_memory's parameter names beside its
short ones, and `--rank` / `--ranks` are accepted alike by cells, `pull` and `debug`."""

from __future__ import annotations

import inspect

import pytest

from fsdp2nb.engine.memory_plan import plan_memory
from fsdp2nb.frontend.magic_options import cell_parser, line_parsers, split_magic_line

PLAN_LONG_NAMES = {"--batch-size": "batch_size", "--seq-len": "seq_len",
                   "--activation-checkpointing": "activation_checkpointing", "--capacity": "capacity_bytes"}


def _parse(command: str, line: str):
    return line_parsers()[command].parse_args(split_magic_line(line))


def test_plan_takes_plan_memorys_names_beside_its_short_ones():
    short = _parse("plan", "./m --cpu 2 --batch 4 --seq 128 --ac --memory 8GiB")
    long = _parse("plan", "./m --cpu 2 --batch-size 4 --seq-len 128 --activation-checkpointing --capacity 8GiB")
    assert vars(short) == vars(long)
    assert (long.batch, long.seq, long.ac, long.memory) == (4, 128, True, "8GiB")


def test_each_long_plan_option_names_a_parameter_of_plan_memory():
    parameters = inspect.signature(plan_memory).parameters
    options = {option for action in line_parsers()["plan"]._actions for option in action.option_strings}
    for option, parameter in PLAN_LONG_NAMES.items():
        assert option in options and parameter in parameters, option


@pytest.mark.parametrize("command", ["pull x", "debug"])
def test_pull_and_debug_take_ranks_as_rank(command):
    name, _, rest = command.partition(" ")
    assert _parse(name, f"{rest} --ranks 1").rank == _parse(name, f"{rest} --rank 1").rank == 1


def test_a_cell_takes_rank_as_ranks():
    parser = cell_parser()
    assert parser.parse_args(["--rank", "1"]).ranks == parser.parse_args(["--ranks", "1"]).ranks == "1"
