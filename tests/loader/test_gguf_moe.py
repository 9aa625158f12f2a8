"""Mixtures of experts from GGUF files laid out as llama.cpp writes them (`tests/gguf_writer.py`:
3-D `ffn_*_exps` tensors, `ffn_gate_inp` routers, Qwen2-MoE's `*_shexp` shared expert,
Mixtral as a "llama" file with experts): the logits equal `transformers` on the same
checkpoint, and quantized experts dequantize to `gguf`'s own values."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from llmserve.loader.gguf import load_gguf, read_gguf_config
from tests.gguf_writer import write_gguf
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_moe_reference import COMMON, tiny_moe
from tests.reference_checks import logit_diff, model_from, random_ids
from tests.tiny_models import randomize


def tiny(kind: str) -> transformers.PreTrainedModel:
    """As the HF tests' checkpoints, in the shapes llama.cpp converts: every Qwen3-MoE
    layer sparse, OLMoE without clip_qkv (llama.cpp reads no such key for it)."""
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=True))
    elif kind == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **COMMON, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1))
    else:
        model = tiny_moe(kind)
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_logits_equal_transformers(tmp_path, kind):
    reference = tiny(kind)
    path = write_gguf(reference, tmp_path / f"{kind}.gguf")
    loaded = load_gguf(path)
    assert loaded.config.architecture == kind
    assert loaded.config.moe.num_experts == reference.config.num_experts if kind != "mixtral" \
        else reference.config.num_local_experts
    diff = logit_diff(model_from(loaded), reference, random_ids(90, 3))
    print(f"{kind} GGUF: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE


@pytest.mark.parametrize(("qtype", "stored"), [(QT.Q8_0, "int8"), (QT.Q4_0, "int4")])
def test_quantized_experts_read_exactly(tmp_path, qtype, stored):
    """Every expert of a quantized 3-D tensor is `gguf`'s dequantization of its own rows;
    the file's format is what "auto" keeps (the F32 router does not count)."""
    model = tiny("qwen3_moe")
    path = write_gguf(model, tmp_path / "q.gguf", qtype)
    loaded = load_gguf(path)
    assert loaded.quantization == stored
    reader = gguf.GGUFReader(path)
    stacked = next(t for t in reader.tensors if t.name == "blk.2.ffn_down_exps.weight")
    assert stacked.tensor_type == qtype
    expected = gguf.quants.dequantize(np.array(stacked.data), qtype)  # (experts, rows, cols)
    for e in range(8):
        got = loaded.tensors[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(got, torch.from_numpy(expected[e].astype(np.float32)))
    router = loaded.tensors["model.layers.2.mlp.gate.weight"]
    assert torch.equal(router, model.model.layers[2].mlp.gate.weight.detach())


def test_config_counts_experts(tmp_path):
    path = write_gguf(tiny("qwen2_moe"), tmp_path / "q2.gguf")
    config = read_gguf_config(path)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (6, 2, 32)
    assert moe.shared_intermediate_size == 48 and moe.norm_topk_prob is False
    assert moe.dense_layers == (0, 2)  # decoder_sparse_step 2: layer 1 alone is sparse
