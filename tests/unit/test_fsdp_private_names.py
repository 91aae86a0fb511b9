"""FSDP2's private attributes are named in `engine/fsdp_internals.py` only, where its canary test
(tests/distributed/test_fsdp_internals.py) watches them."""

from __future__ import annotations

import re
from pathlib import Path

import fsdp2nb

PRIVATE_NAMES = re.compile(
    r"_get_fsdp_state|_fsdp_param_groups?\b|_mp_policy|post_forward_mesh_info|_all_gather_result|_state_ctx"
    r"|_auto_reshard_after_forward|_(pre|post)_forward_hook_handle|\._is_root|\._parameters\["
    r"|(?<![a-z])_forward_(pre_)?hooks|torch\.distributed\.fsdp\._")


def test_no_module_but_fsdp_internals_names_fsdp2_s_private_parts():
    package = Path(fsdp2nb.__file__).parent
    naming = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                    if PRIVATE_NAMES.search(path.read_text()))
    assert naming == ["engine/fsdp_internals.py"]
