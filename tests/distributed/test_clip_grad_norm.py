"""`fsdp2nb.clip_grad_norm_` against torch's own on an FSDP2 model, on 2 gloo ranks, on the flat
mesh and on HSDP's: the same norm (that of the whole gradient, as one process would compute it)
and the same clipped gradients. fsdp2nb's takes parameters like torch's and returns a plain
tensor; given the module (the earlier spelling) it returns a float, as before."""

from __future__ import annotations

import pytest
import torch

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks

pytest.importorskip("transformers")

WORLD_SIZE = 2
MAX_NORM = 0.01  # under the first norm, so clipping acts
CLIPPERS = ("torch", "fsdp2nb", "fsdp2nb_module")


def _model_with_gradients(path: str, mesh_kind: str):
    import torch.distributed as dist

    import fsdp2nb

    mesh = fsdp2nb.hsdp_mesh(replicate=WORLD_SIZE) if mesh_kind == "hsdp" else None
    model, _ = fsdp2nb.load_model(path, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32", mesh=mesh))
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def _full_gradients(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]


def _clip(path: str, mesh_kind: str, clipper: str) -> dict:
    import fsdp2nb

    model = _model_with_gradients(path, mesh_kind)
    whole = torch.linalg.vector_norm(torch.stack([g.norm() for g in _full_gradients(model)]))
    if clipper == "torch":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor()
    elif clipper == "fsdp2nb":
        norm = fsdp2nb.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        norm = fsdp2nb.clip_grad_norm_(model, MAX_NORM)
    return dict(kind=type(norm).__name__, norm=float(norm), whole=float(whole), clipped=_full_gradients(model))


def _refusal() -> str:
    import fsdp2nb
    from fsdp2nb.errors import InvalidValue

    with pytest.raises(InvalidValue) as caught:
        fsdp2nb.clip_grad_norm_(3, 1.0)
    return str(caught.value)


def _all_runs(path: str) -> dict:
    runs = {(mesh_kind, clipper): _clip(path, mesh_kind, clipper) for mesh_kind in ("flat", "hsdp") for clipper in CLIPPERS}
    return dict(runs=runs, refusal=_refusal())


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")
    return run_ranks(_all_runs, WORLD_SIZE, str(path))


@pytest.mark.parametrize("mesh_kind", ["flat", "hsdp"])
def test_torch_and_fsdp2nb_give_the_whole_gradients_norm_and_clip_alike(per_rank, mesh_kind):
    for result in per_rank:
        runs = {clipper: result["runs"][mesh_kind, clipper] for clipper in CLIPPERS}
        whole = runs["torch"]["whole"]
        assert whole > MAX_NORM  # clipping acted
        for clipper, run in runs.items():
            assert run["norm"] == pytest.approx(whole, rel=1e-6), clipper
            for mine, theirs in zip(run["clipped"], runs["torch"]["clipped"], strict=True):
                torch.testing.assert_close(mine, theirs)
        clipped_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in runs["fsdp2nb"]["clipped"]]))
        assert float(clipped_norm) == pytest.approx(MAX_NORM, rel=1e-4)
    assert per_rank[0]["runs"][mesh_kind, "fsdp2nb"]["norm"] == per_rank[1]["runs"][mesh_kind, "fsdp2nb"]["norm"]


def test_parameters_give_a_plain_tensor_and_a_module_a_float(per_rank):
    runs = per_rank[0]["runs"]
    assert runs["flat", "fsdp2nb"]["kind"] == "Tensor"  # not torch's replicated DTensor
    assert runs["flat", "fsdp2nb_module"]["kind"] == "float"


def test_a_value_that_is_no_parameters_is_refused_in_one_line(per_rank):
    assert per_rank[0]["refusal"].startswith("parameters=int is not allowed; pass model.parameters()")
