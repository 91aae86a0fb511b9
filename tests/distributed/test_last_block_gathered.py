"""Between forward and backward the engine keeps gathered what backward needs first, the head
and the last block (their parameters plain tensors), and every other block sharded (DTensors)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.support.gloo_harness import run_ranks


def _sharded_after_forward() -> dict:
    from fsdp2nb.engine import wrapping
    from fsdp2nb.examples.tiny_models import make_tiny_model

    model = make_tiny_model("llama", num_hidden_layers=3)
    wrapping.shard_units(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                         mp_policy=wrapping.mixed_precision_policy("fp32"), offload_policy=None,
                         reshard_after_forward=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    blocks = [isinstance(next(block.parameters()), DTensor) for block in model.model.layers]
    head = isinstance(model.get_output_embeddings().weight, DTensor)
    loss.backward()
    after_backward = [isinstance(next(block.parameters()), DTensor) for block in model.model.layers]
    return {"blocks_sharded": blocks, "head_sharded": head, "blocks_sharded_after_backward": after_backward}


def test_the_last_block_and_the_head_stay_gathered_for_backward():
    for result in run_ranks(_sharded_after_forward, 2):
        assert result == {"blocks_sharded": [True, True, False], "head_sharded": False,
                          "blocks_sharded_after_backward": [True, True, True]}
