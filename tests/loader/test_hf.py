"""Hugging Face folder loader on tiny random Llama / Qwen2 / Qwen3 models."""

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: E402

from llmserve.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from llmserve.loader.hf import load_hf_folder

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def _save_tiny(
    folder: Path, config_cls: str, model_cls: str, **overrides: object
) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(folder)
    return model


def _assert_same_weights(folder: Path, model: torch.nn.Module, tied: bool) -> None:
    loaded = load_hf_folder(folder)
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    assert set(loaded.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.tensors[name], tensor), name
    assert loaded.config.tie_word_embeddings == tied
    assert loaded.metadata["model_type"] == model.config.model_type


def test_llama(tmp_path: Path) -> None:
    model = _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    _assert_same_weights(tmp_path, model, tied=False)
    config = load_hf_folder(tmp_path).config
    assert (config.architecture, config.num_key_value_heads, config.head_dim) == ("llama", 2, 16)


def test_llama_sharded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_same_weights(tmp_path, model, tied=False)


def test_qwen2_bias_and_tied(tmp_path: Path) -> None:
    model = _save_tiny(tmp_path, "Qwen2Config", "Qwen2ForCausalLM", tie_word_embeddings=True)
    assert "model.layers.0.self_attn.q_proj.bias" in model.state_dict()
    _assert_same_weights(tmp_path, model, tied=True)
    assert load_hf_folder(tmp_path).config.attention_bias


def test_qwen3_qk_norm(tmp_path: Path) -> None:
    model = _save_tiny(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32)
    assert "model.layers.0.self_attn.q_norm.weight" in model.state_dict()
    tied = model.config.tie_word_embeddings
    _assert_same_weights(tmp_path, model, tied=tied)
    config = load_hf_folder(tmp_path).config
    assert config.qk_norm and config.head_dim == 32


def test_dtype_cast(tmp_path: Path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    loaded = load_hf_folder(tmp_path, dtype=torch.bfloat16)
    assert {t.dtype for t in loaded.tensors.values()} == {torch.bfloat16}


# --- errors -----------------------------------------------------------------------------------


def _raises(error_cls: type[Exception], match: str, folder: Path) -> None:
    with pytest.raises(error_cls, match=match) as error:
        load_hf_folder(folder)
    assert "\n" not in str(error.value)


def test_missing_folder(tmp_path: Path) -> None:
    _raises(ModelNotFoundError, "not found", tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    _raises(ModelFormatError, "no config.json", tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    _raises(UnsupportedModelError, "architecture 'gpt_neox'", tmp_path)


def test_config_missing_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _raises(ModelFormatError, "lacks the field", tmp_path)


def test_pytorch_bin_unsupported(tmp_path: Path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    for file in tmp_path.glob("*.safetensors"):
        file.rename(tmp_path / "pytorch_model.bin")
    _raises(UnsupportedModelError, "pytorch_model.bin", tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    _raises(ModelFormatError, "no \\*.safetensors", tmp_path)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    _save_tiny(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    _raises(ModelFormatError, "cannot read", tmp_path)
