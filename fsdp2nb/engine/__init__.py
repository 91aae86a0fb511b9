"""FSDP2 for transformers models: sharding, sliced checkpoint loading, LoRA, gradient clipping,
generation and evaluation over the ranks.

Needs only an initialised torch.distributed process group; usable from torchrun scripts as well
as from notebook ranks.
"""

from fsdp2nb.engine.config import EngineConfig
from fsdp2nb.engine.engine import FSDP2Engine
from fsdp2nb.engine.evaluation import Evaluation, evaluate
from fsdp2nb.engine.generation import generate
from fsdp2nb.engine.grad import clip_grad_norm_
from fsdp2nb.engine.loader import load_model
from fsdp2nb.engine.mesh import InvalidMesh, hsdp_mesh
from fsdp2nb.engine.sharded_load import LoadReport

__all__ = ["EngineConfig", "Evaluation", "FSDP2Engine", "InvalidMesh", "LoadReport", "clip_grad_norm_", "evaluate",
           "generate", "hsdp_mesh", "load_model"]
