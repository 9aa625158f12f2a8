"""GGUF loader: the default model against transformers' GGUF loader, kernels against gguf's."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from llmserve.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from llmserve.loader.gguf import hf_name, load_gguf
from llmserve.loader.gguf_dequant import DEQUANTIZERS
from llmserve.loader.weights import LoadedWeights

REFERENCE_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


@pytest.fixture(scope="session")
def loaded(smollm2_gguf: Path) -> LoadedWeights:
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def reference(reference_model) -> torch.nn.Module:
    """`transformers` on the same GGUF (the suite's one load of it)."""
    return reference_model


def test_tensors_equal_transformers(loaded: LoadedWeights, reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    if loaded.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(loaded.tensors) == set(expected)
    for name, tensor in expected.items():
        got = loaded.tensors[name]
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, tensor, rtol=0, atol=1e-6, msg=name)


def test_config_equals_transformers(loaded: LoadedWeights, reference: torch.nn.Module) -> None:
    ref = reference.config
    assert loaded.config.architecture == ref.model_type == "llama"
    for field in REFERENCE_CONFIG_FIELDS:
        assert getattr(loaded.config, field) == pytest.approx(getattr(ref, field)), field
    rope = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert loaded.config.rope_theta == rope["rope_theta"] == 100000.0
    assert loaded.config.tie_word_embeddings
    assert not loaded.config.attention_bias and not loaded.config.qk_norm


def test_metadata_carries_tokenizer(loaded: LoadedWeights) -> None:
    assert loaded.metadata["general.architecture"] == "llama"
    assert len(loaded.metadata["tokenizer.ggml.tokens"]) == loaded.config.vocab_size
    assert "<|im_start|>" in loaded.metadata["tokenizer.chat_template"]


def test_dtype_cast(smollm2_gguf: Path) -> None:
    weights = load_gguf(smollm2_gguf, dtype=torch.bfloat16)
    assert {t.dtype for t in weights.tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize("qtype", list(DEQUANTIZERS), ids=lambda q: q.name)
def test_dequantize_matches_gguf(qtype: QT) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    # Random bytes exercise every bit pattern, infinities and NaN scales included.
    raw = rng.integers(0, 256, size=(64, 2 * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    got = DEQUANTIZERS[qtype](torch.from_numpy(raw.reshape(-1))).float()
    torch.testing.assert_close(
        got.reshape(expected.shape), torch.from_numpy(expected), rtol=0, atol=0, equal_nan=True
    )


def test_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


# --- errors -----------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, QT]]) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_one_line(error: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(error.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found") as error:
        load_gguf(tmp_path / "nope.gguf")
    _assert_one_line(error)


def test_truncated_file(smollm2_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with smollm2_gguf.open("rb") as src:
        truncated.write_bytes(src.read(1 << 20))
    with pytest.raises(ModelFormatError, match="truncated") as error:
        load_gguf(truncated)
    _assert_one_line(error)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelFormatError) as error:
        load_gguf(bogus)
    _assert_one_line(error)


def test_unsupported_architecture(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": (np.zeros((8, 4), np.float32), QT.F32),
        "blk.0.time_mix_lerp_x.weight": (np.zeros(4, np.float32), QT.F32),
    }
    path = _write_gguf(tmp_path / "rwkv.gguf", "rwkv6", tensors)
    with pytest.raises(UnsupportedModelError, match="architecture 'rwkv6'") as error:
        load_gguf(path)
    _assert_one_line(error)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    _, type_size = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS]
    tensors = {
        "token_embd.weight": (np.zeros((8, 256), np.float32), QT.F32),
        "blk.0.attn_q.weight": (np.zeros((4, type_size), np.uint8), QT.IQ2_XXS),
    }
    path = _write_gguf(tmp_path / "iq.gguf", "llama", tensors)
    expected = "unsupported GGUF tensor type IQ2_XXS in blk.0.attn_q.weight"
    with pytest.raises(UnsupportedModelError, match=expected) as error:
        load_gguf(path)
    _assert_one_line(error)
