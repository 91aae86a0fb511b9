"""Engine pieces that need no process group: config checks, block discovery, key mapping, Hub resolution."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2nb.engine.config import EngineConfig, check_offload_supported
from fsdp2nb.engine.device import drives_gpus, gpu_index
from fsdp2nb.engine.hf_files import Block, find_checkpoint_files, open_reader
from fsdp2nb.engine.hub import resolve_model_dir
from fsdp2nb.engine.key_mapping import checkpoint_to_model_keys, hf_key
from fsdp2nb.engine.wrapping import embedding_and_head, find_blocks
from fsdp2nb.examples.tiny_models import tiny_config


def _meta_model(family: str = "llama", tied: bool = False):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, tie_word_embeddings=tied), dtype=torch.float32)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [("mixed_precision", "fp16", "('bf16', 'fp32')"), ("reshard_after_forward", 1, "(True, False)"),
     ("offload_params", "yes", "(True, False)"), ("pin_memory", None, "(True, False)")],
)
def test_bad_config_values_name_field_value_and_choices(field, value, allowed):
    with pytest.raises(ValueError) as error:
        EngineConfig(**{field: value})
    message = str(error.value)
    assert f"{field}={value!r}" in message and allowed in message


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        EngineConfig("fp32")  # type: ignore[misc]
    assert EngineConfig(mixed_precision="fp32").mixed_precision == "fp32"


def test_offload_is_refused_on_cpu_and_without_a_cpu_backend():
    with pytest.raises(ValueError, match="offload_params=True is not allowed on CPU"):
        check_offload_supported(True, "cpu", "cpu:gloo")
    with pytest.raises(ValueError, match="cuda:nccl,cpu:gloo"):
        check_offload_supported(True, "cuda", "cuda:nccl")
    check_offload_supported(True, "cuda", "cuda:nccl,cpu:gloo")
    check_offload_supported(False, "cpu", "cpu:gloo")


def test_load_model_rejects_unknown_init_before_touching_the_process_group():
    from fsdp2nb.engine import load_model

    with pytest.raises(ValueError, match=r"init='lazy' .*\('meta', 'rank0', 'default'\)"):
        load_model("unused", init="lazy")



def test_every_declared_block_class_is_found():
    model = _meta_model()
    blocks = find_blocks(model)
    assert blocks == list(model.model.layers)
    # A second declared class (as in vision-language models) is picked up as well.
    model._no_split_modules = ["LlamaDecoderLayer", "LlamaRMSNorm"]
    names = {type(b).__name__ for b in find_blocks(model)}
    assert names == {"LlamaDecoderLayer", "LlamaRMSNorm"}
    assert len(find_blocks(model)) == 3  # two layers (their inner norms not counted twice) + final norm


@pytest.mark.parametrize("tied", [False, True])
def test_tie_detection(tied):
    _, _, is_tied = embedding_and_head(_meta_model("qwen2", tied))
    assert is_tied is tied


def test_checkpoint_keys_without_base_prefix_map_to_model_keys():
    model = _meta_model()
    model_keys = list(model.state_dict())
    bare = [k.removeprefix("model.") for k in model_keys]
    mapping = checkpoint_to_model_keys(model, bare, model_keys)
    assert mapping["model.layers.0.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj.weight"
    assert mapping["lm_head.weight"] == "lm_head.weight"


def test_peft_keys_translate_to_checkpoint_names():
    assert hf_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", True) == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert hf_key("model.norm.weight", False) == "model.norm.weight"


def test_local_directories_are_used_as_they_are(tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("a local path must not reach the Hub")

    assert resolve_model_dir(tmp_path, download=forbidden) == str(tmp_path)


@pytest.mark.parametrize(("env", "offline"), [("1", True), ("0", False)])
def test_hub_ids_honour_hf_hub_offline(monkeypatch, env, offline):
    calls = []
    monkeypatch.setenv("HF_HUB_OFFLINE", env)
    monkeypatch.setenv("LOCAL_RANK", "0")

    def fake_download(repo_id, *, local_files_only):
        calls.append((repo_id, local_files_only))
        return "/cache/snapshot"

    assert resolve_model_dir("org/model", download=fake_download) == "/cache/snapshot"
    assert calls == [("org/model", offline)]


def test_other_local_ranks_never_download(monkeypatch):
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    resolve_model_dir("org/model", download=lambda repo, *, local_files_only: calls.append(local_files_only) or "/c")
    assert calls == [True]


def test_a_directory_without_weights_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        find_checkpoint_files(tmp_path)


@pytest.mark.parametrize("missing", ["/models/Qwen2.5-0.5B", "./checkpoints/run1", "~/models/x", "a/b/c"])
def test_a_missing_local_path_is_reported_as_one(missing):
    def forbidden(*args, **kwargs):
        raise AssertionError("a path must not reach the Hub")

    with pytest.raises(FileNotFoundError, match="is not a model directory .it does not exist"):
        resolve_model_dir(missing, download=forbidden)


def test_a_quantized_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="quantized checkpoint .quant_method='fp8'.*bf16/fp16/fp32 release"):
        find_checkpoint_files(tmp_path)


def test_a_legacy_format_bin_loads(tmp_path):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    files = find_checkpoint_files(tmp_path)
    assert list(files.key_to_file) == ["w"]
    with open_reader(files, "pytorch_model.bin") as reader:
        out = torch.empty(2)
        reader.copy_blocks([Block("w", (slice(1, 3),), out)])
    assert out.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(("config", "gpus"), [
    ("cuda:nccl,cpu:gloo", True), ("cuda:nccl", True), ("cpu:gloo,cuda:gloo", False), ("cpu:gloo", False),
])
def test_shards_go_to_gpus_only_with_a_gpu_backend(config, gpus):
    assert drives_gpus(config) == gpus


@pytest.mark.parametrize(("chosen", "local_rank", "count", "index"), [
    (None, "3", 4, 3),  # torchrun without set_device: LOCAL_RANK's GPU, not GPU 0 for all
    (2, "3", 4, 2),     # chosen with set_device: kept
    (0, "1", 4, 0),     # chosen GPU 0 (a `--gpus 1,0` pool's rank 1): kept
    (None, "1", 1, 0),  # one visible GPU per rank (CUDA_VISIBLE_DEVICES)
    (None, None, 4, 0),
])
def test_gpu_index(chosen, local_rank, count, index):
    assert gpu_index(chosen, local_rank, count) == index
