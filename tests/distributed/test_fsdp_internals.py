"""The canary for FSDP2's private parts (`engine.fsdp_internals`): on 2 gloo ranks, every attribute
fsdp2nb reads exists on this torch and holds what fsdp2nb expects; a missing one is named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp2nb.engine import fsdp_internals
from tests.support.gloo_harness import run_ranks


def _two_unit_model(reshard_after_forward: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _read_every_internal() -> dict:
    model = _two_unit_model()
    model(torch.ones(3, 4)).sum().backward()
    fsdp_internals.check_internals(model)
    block = model[0]
    hook_ids = fsdp_internals.forward_hook_ids(block)
    tables_holding_them = sum(not hook_ids.isdisjoint(getattr(block, name)) for name in fsdp_internals.FORWARD_HOOK_TABLES)
    settings = fsdp_internals.reshard_settings(block)
    block.set_reshard_after_forward(False)
    changed = fsdp_internals.reshard_settings(block)
    fsdp_internals.restore_reshard_settings(block, settings)
    with fsdp_internals.forward_hooks_removed(model, hook_ids):
        hooks_while_removed = sum(not hook_ids.isdisjoint(getattr(block, name)) for name in fsdp_internals.FORWARD_HOOK_TABLES)
    return {
        "roots": [fsdp_internals.is_root(model), fsdp_internals.is_root(block)],
        "gather_dtype": fsdp_internals.gather_dtype(model),
        "states": len(fsdp_internals.states_under(model)),
        "groups": len(fsdp_internals.param_groups(fsdp_internals.fsdp_state(block))),
        "backward_cut_short": fsdp_internals.backward_cut_short(model),
        "hook_tables": tables_holding_them,
        "hooks_while_removed": hooks_while_removed,
        "hook_tables_after": sum(not hook_ids.isdisjoint(getattr(block, name)) for name in fsdp_internals.FORWARD_HOOK_TABLES),
        "settings_changed": changed != settings,
        "settings_restored": fsdp_internals.reshard_settings(block) == settings,
    }


def test_every_private_attribute_fsdp2nb_reads_is_there_and_means_what_it_did():
    for result in run_ranks(_read_every_internal, 2):
        assert result == {
            "roots": [True, False], "gather_dtype": torch.bfloat16, "states": 2, "groups": 1,
            "backward_cut_short": False, "hook_tables": 3, "hooks_while_removed": 0, "hook_tables_after": 3,
            "settings_changed": True, "settings_restored": True,
        }


def test_a_missing_attribute_is_named_with_the_torch_in_use():
    class StateOfAnotherTorch:
        _fsdp_param_groups_renamed: list = []

    with pytest.raises(fsdp_internals.TorchInternalsChanged, match=r"has no '_fsdp_param_groups'.*pyproject") as raised:
        fsdp_internals.param_groups(StateOfAnotherTorch())
    assert torch.__version__ in str(raised.value)
