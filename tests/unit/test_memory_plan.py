"""`fsdp2nb.plan_memory` without ranks: sharding arithmetic, the activation trace against a real
CPU forward, the verdict, the table, and refusals of bad input. What ranks really hold is
compared with plans in tests/kernel/test_memory.py."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2nb.engine.activation_trace import FusedAttention, trace_activations
from fsdp2nb.engine.config import EngineConfig
from fsdp2nb.engine.memory_plan import CATEGORIES, plan_memory
from fsdp2nb.engine.model_census import build_meta_model, param_layout, rows_per_rank
from fsdp2nb.examples.tiny_models import make_tiny_model, tiny_config


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A model directory holding only config.json: a plan reads no weights."""
    directory = tmp_path_factory.mktemp("plan") / "tiny"
    tiny_config().save_pretrained(directory)
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    return directory


@pytest.mark.parametrize(("rows", "world_size"), [(131, 3), (5, 4), (10, 3), (1, 8), (8, 8), (0, 2)])
def test_rows_per_rank_is_torch_chunk_padded_with_empty_ranks(rows, world_size):
    chunks = [len(c) for c in torch.chunk(torch.empty(rows), world_size)]
    assert rows_per_rank(rows, world_size) == tuple(chunks + [0] * (world_size - len(chunks)))


def test_uneven_shards_pad_parameters_but_not_optimizer_state(config_dir):
    plan = plan_memory(config_dir, 3, engine=EngineConfig(mixed_precision="fp32"), device="cpu",
                       batch_size=2, seq_len=16)
    assert len(plan.per_rank) == 3 and all(set(figures) == set(CATEGORIES) for figures in plan.per_rank)
    assert len({figures["parameters"] for figures in plan.per_rank}) == 1  # padded alike
    assert plan.per_rank[0]["optimizer"] > plan.per_rank[2]["optimizer"]  # vocab 131: 44, 44, 43 rows
    model = make_tiny_model()
    padded = sum(rows_per_rank(p.shape[0], 3)[0] * p[0].numel() * 4 for p in model.parameters())
    assert plan.per_rank[0]["parameters"] == padded == plan.per_rank[0]["gradients"]


def test_lora_freezes_the_base_in_the_compute_dtype(config_dir):
    full = plan_memory(config_dir, 2, device="cpu", seq_len=16)
    lora = plan_memory(config_dir, 2, device="cpu", seq_len=16, lora=4)
    assert lora.settings.lora_rank == 4
    assert lora.per_rank[0]["gradients"] < full.per_rank[0]["gradients"] / 3
    # bf16 base (half of fp32) plus small fp32 adapters
    assert full.per_rank[0]["parameters"] / 2 < lora.per_rank[0]["parameters"] < full.per_rank[0]["parameters"]


@pytest.mark.parametrize(("family", "dtype", "overrides"), [
    ("llama", torch.float32, {}),
    ("llama", torch.bfloat16, dict(num_hidden_layers=5)),
    ("qwen2", torch.float32, dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=8,
                                  layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"])),
], ids=["llama-2-layers-fp32", "llama-5-layers-bf16", "qwen2-mixed-layers"])
def test_the_meta_trace_counts_what_a_real_cpu_forward_saves(family, dtype, overrides):
    """The CPU's fused attention saves what the traced one does; parameters are left out of both.
    With 5 layers two of each kind are traced, the second standing for the rest."""
    torch.manual_seed(0)
    model = make_tiny_model(family, **overrides).to(dtype)
    params = {id(p.untyped_storage()) for p in model.parameters()}
    saved = {}

    def pack(tensor):
        saved[id(tensor.untyped_storage())] = tensor.untyped_storage()
        return tensor

    ids = torch.randint(0, 131, (2, 24))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    real = sum(s.nbytes() for key, s in saved.items() if key not in params)
    planned = build_meta_model(tiny_config(family, **overrides), None, dtype)
    assert len(planned.model.model.layers) < model.config.num_hidden_layers or model.config.num_hidden_layers == 2
    traced = trace_activations(planned, 2, 24, dtype)
    assert traced.error is None
    assert abs(traced.saved_bytes / real - 1) < 0.01, (traced.saved_bytes, real)


def test_kept_blocks_stand_for_the_parameters_of_those_left_out():
    model = make_tiny_model(num_hidden_layers=6)
    layout = param_layout(build_meta_model(tiny_config(num_hidden_layers=6), None, torch.float32))
    assert sum(p.rows * p.row_numel * p.count for p in layout.params) == sum(p.numel() for p in model.parameters())
    assert sorted(layout.unit_counts) == [1, 1, 1, 1, 5]  # two blocks kept, embedding, head, root


def test_fused_attention_saves_no_scores_matrix():
    query = torch.empty(1, 4, 512, 16, device="meta", requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t), \
            FusedAttention():
        torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert max(sizes) < 512 * 512  # query-sized at most, not heads x S x S


def test_checkpointing_and_batch_change_activations(config_dir):
    plain = plan_memory(config_dir, 2, device="cpu", seq_len=64, batch_size=2)
    ac = plan_memory(config_dir, 2, device="cpu", seq_len=64, batch_size=2, activation_checkpointing=True)
    double = plan_memory(config_dir, 2, device="cpu", seq_len=64, batch_size=4)
    assert 0 < ac.per_rank[0]["activations"] < plain.per_rank[0]["activations"]
    # traced again at batch 4: all but the rotary tables (shared by the batch) doubles
    assert 1.9 < double.per_rank[0]["activations"] / plain.per_rank[0]["activations"] <= 2


def test_verdicts_say_what_spares_or_what_to_change(config_dir):
    fits = plan_memory(config_dir, 2, seq_len=64, capacity_bytes=2**30)
    assert fits.verdict.startswith("fits with ") and "to spare" in fits.verdict
    need = max(fits.device_bytes(r) for r in range(2))
    short = plan_memory(config_dir, 2, seq_len=64, capacity_bytes=int(need * 0.8))
    assert short.verdict.startswith(f"does not fit: rank {short.busiest_rank} needs")
    assert "it would fit with " in short.verdict
    unknown = plan_memory(config_dir, 2, seq_len=64, capacity_bytes=None, device="cuda")
    if unknown.capacity_bytes is None:  # no nvidia-smi here
        assert "unknown" in unknown.verdict and "--memory" in unknown.verdict


def test_offloading_moves_sharded_state_to_the_host(config_dir):
    plan = plan_memory(config_dir, 2, seq_len=16, engine=EngineConfig(offload_params=True), capacity_bytes=2**30)
    assert plan.on_host == ("parameters", "gradients", "optimizer")
    assert plan.device_bytes(0) == plan.per_rank[0]["activations"] + plan.per_rank[0]["gathered"]


def test_the_table_groups_ranks_with_the_same_figures(config_dir):
    plan = plan_memory(config_dir, 3, device="cpu", seq_len=16)
    text, markup = str(plan), plan._repr_html_()
    assert "ranks 0-1" in text and "rank 2" in text and "optimizer state" in text
    assert plan.verdict in text and "<table>" in markup and "ranks 0-1" in markup


def test_a_config_json_path_and_a_config_object_plan_alike(config_dir):
    by_dir = plan_memory(config_dir, 2, device="cpu", seq_len=16)
    by_file = plan_memory(config_dir / "config.json", 2, device="cpu", seq_len=16)
    by_object = plan_memory(tiny_config(), 2, device="cpu", seq_len=16)
    assert by_dir.per_rank == by_file.per_rank == by_object.per_rank


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(world_size=0), "world_size=0"),
    (dict(optimizer="lion"), "optimizer='lion'"),
    (dict(lora="big"), "lora='big'"),
    (dict(batch_size=1.5), "batch_size=1.5"),
    (dict(engine=EngineConfig(offload_params=True), device="cpu"), "offload_params=True is not allowed on CPU"),
])
def test_bad_arguments_say_which_and_what_is_allowed(config_dir, kwargs, words):
    kwargs = dict(world_size=2) | kwargs
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        plan_memory(config_dir, kwargs.pop("world_size"), **kwargs)


def test_a_hub_id_outside_the_cache_is_refused_without_network(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        plan_memory("someone/not-cached-model", 2)


def test_a_quantized_config_is_refused(tmp_path):
    config = tiny_config().to_dict() | {"quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized"):
        plan_memory(tmp_path, 2)
