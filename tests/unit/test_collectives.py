"""The collective helpers work in one process without a process group, as one rank of one (as
collectives.py says of each)."""

from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp2nb import collectives
from fsdp2nb.errors import FailedElsewhere


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()


def test_all_max_without_a_process_group_is_its_values():
    assert collectives.all_max((3, -1, 7)) == (3, -1, 7)
    assert collectives.post_all_max((3, -1)).wait() == (3, -1)


def test_agreement_helpers_without_a_process_group(tmp_path: Path):
    assert (collectives.get_rank(), collectives.get_world_size()) == (0, 1)
    collectives.all_ranks_succeeded(None, "a step")
    with pytest.raises(OSError, match="disk"):
        collectives.all_ranks_succeeded(OSError("disk full"), "a step")
    assert collectives.on_rank0_agreed(lambda: 42, "an answer") == 42
    collectives.make_dir_on_rank0_then_everywhere(tmp_path / "a" / "b", "a directory")
    assert (tmp_path / "a" / "b").is_dir()
    assert issubclass(FailedElsewhere, RuntimeError)
