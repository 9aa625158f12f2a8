"""AWQ, GPTQ (with and without act-order, v1 and v2 zero points, 4 and 8 bits) and FP8
(per-channel and block scales) checkpoints: each linear packed here as its format lays it
out (AutoAWQ's GEMM order 0 2 4 6 1 3 5 7; GPTQ's consecutive rows per int32 and its
g_idx; float8 with weight_scale / weight_scale_inv) reads back as exactly the float values
it encodes, and the engine on those values equals `transformers` on the same floats."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from llmserve import LLM, SamplingParams
from llmserve.errors import UnsupportedModelError
from llmserve.loader.hf import load_hf_folder
from tests.models.test_llama_reference import reference_greedy
from tests.tiny_models import randomize, save_byte_tokenizer

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i holds column order[i]


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def pack_rows(values: np.ndarray, bits: int) -> torch.Tensor:
    """(rows, cols) -> (rows / k, cols): k = 32 / bits consecutive rows a word."""
    k = 32 // bits
    v = values.astype(np.int64).reshape(-1, k, values.shape[1])
    return _int32(sum(v[:, j] << (bits * j) for j in range(k)))


def pack_columns(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None
                 ) -> torch.Tensor:
    """(rows, cols) -> (rows, cols / k): k consecutive columns a word (in `order`)."""
    k = 32 // bits
    order = order or tuple(range(k))
    v = values.astype(np.int64).reshape(values.shape[0], -1, k)
    return _int32(sum(v[:, :, order[j]] << (bits * j) for j in range(k)))


def grid(rng: np.random.Generator, rows: int, cols: int, bits: int, g_idx: np.ndarray,
         lowest_zero: int = 0):
    """Random codes (in, out), zeros and fp16 scales (groups, out), and the float weight
    (out, in) they encode. (GPTQ's v1 format stores a zero minus one: a zero of 0 cannot
    be stored, so its zeros start at 1.)"""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    q = rng.integers(0, top + 1, size=(rows, cols))
    zeros = rng.integers(lowest_zero, top + 1, size=(groups, cols))
    scales = torch.from_numpy(rng.uniform(0.002, 0.02, size=(groups, cols))).half()
    weight = (torch.from_numpy(q - zeros[g_idx]).float() * scales.float()[g_idx]).t()
    return q, zeros, scales, weight.contiguous()


def write_checkpoint(folder, kind: str) -> transformers.LlamaForCausalLM:
    """A tiny Llama whose linears are stored quantized as `kind`; returns the float model
    with the values they encode (the reference)."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    randomize(model)
    rng = np.random.default_rng(7)
    tensors, state = {}, model.state_dict()
    method, bits, act_order = kind.split("-")[0], 8 if "8bit" in kind else 4, "actorder" in kind
    v1 = method == "gptq" and "v2" not in kind
    for name, value in state.items():
        prefix, _, part = name.rpartition(".")
        if prefix.rpartition(".")[2] not in LINEARS:
            tensors[name] = value.contiguous()
            continue
        cols, rows = value.shape  # (out, in)
        if method == "fp8":
            weight, scale_parts = fp8_linear(rng, value, "block" in kind)
            tensors |= {f"{prefix}.{k}": v for k, v in scale_parts.items()}
            tensors[name] = weight
            state[name] = fp8_value(weight, scale_parts)
            continue
        g_idx = np.arange(rows) // GROUP
        if act_order:  # rows of a group scattered over the input
            g_idx = g_idx[rng.permutation(rows)]
        q, zeros, scales, weight = grid(rng, rows, cols, bits, g_idx, int(v1))
        state[name] = weight
        if method == "awq":
            tensors |= {f"{prefix}.qweight": pack_columns(q, 4, AWQ_PACK_ORDER),
                        f"{prefix}.qzeros": pack_columns(zeros, 4, AWQ_PACK_ORDER),
                        f"{prefix}.scales": scales}
        else:
            tensors |= {f"{prefix}.qweight": pack_rows(q, bits),
                        f"{prefix}.qzeros": pack_columns(zeros - (1 if v1 else 0), bits),
                        f"{prefix}.scales": scales,
                        f"{prefix}.g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    model.load_state_dict(state)
    save_file(tensors, folder / "model.safetensors")
    config = model.config.to_dict() | {"quantization_config": quantization_config(kind)}
    (folder / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(folder)
    return model.eval()


def quantization_config(kind: str) -> dict:
    if kind.startswith("awq"):
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}
    if kind.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if "8bit" in kind else 4,
                "group_size": GROUP, "desc_act": "actorder" in kind, "sym": False,
                "checkpoint_format": "gptq_v2" if "v2" in kind else "gptq"}
    block = {"weight_block_size": [32, 32]} if "block" in kind else {}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", **block}


def fp8_linear(rng, value: torch.Tensor, block: bool):
    weight = (value * 20).to(torch.float8_e4m3fn)
    if block:
        n, k = value.shape
        inverse = torch.from_numpy(rng.uniform(0.01, 0.1, size=(-(-n // 32), -(-k // 32))))
        return weight, {"weight_scale_inv": inverse.float()}
    return weight, {"weight_scale": torch.from_numpy(
        rng.uniform(0.01, 0.1, size=(value.shape[0], 1))).float()}


def fp8_value(weight: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    values = weight.float()
    if "weight_scale" in scales:
        return values * scales["weight_scale"]
    inverse = scales["weight_scale_inv"]
    return values * inverse.repeat_interleave(32, 0).repeat_interleave(32, 1)[
        :values.shape[0], :values.shape[1]]


KINDS = ["awq", "gptq", "gptq-actorder", "gptq-v2", "gptq-8bit", "fp8", "fp8-block"]


@pytest.mark.parametrize("kind", KINDS)
def test_linears_read_as_the_values_they_encode(tmp_path, kind):
    reference = write_checkpoint(tmp_path, kind)
    loaded = load_hf_folder(tmp_path)
    assert loaded.quantization == ("int4" if kind in ("awq", "gptq", "gptq-v2") else "int8")
    expected = reference.state_dict()
    for name, tensor in loaded.tensors.items():
        assert torch.equal(tensor, expected[name].float()), name


@pytest.mark.parametrize("kind", ["awq", "gptq-actorder", "fp8-block"])
def test_engine_equals_transformers_on_the_encoded_values(tmp_path, kind):
    """float32 on the dequantized values: greedy tokens are the reference's."""
    reference = write_checkpoint(tmp_path, kind)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (20, 33)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == \
        [reference_greedy(reference, p, 10) for p in prompts]



def test_unsupported_schemes_are_refused_by_name(tmp_path):
    write_checkpoint(tmp_path, "awq")
    config = json.loads((tmp_path / "config.json").read_text())
    for qc, message in [({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
                        ({"quant_method": "gptq", "bits": 3}, "bits 3"),
                        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'")]:
        (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
        with pytest.raises(UnsupportedModelError, match=message):
            load_hf_folder(tmp_path)


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_int4_groups_keep_the_checkpoint_values(tmp_path, kind):
    """The int4 kernel's groups of 32 (what "auto" packs a 4-bit checkpoint as) give back
    each checkpoint value: exactly up to the fp16 rounding of the group's offset where the
    group's codes span 0-15 (the packed step is then the checkpoint's), within half the
    checkpoint's step everywhere."""
    from llmserve.quantization.int4 import dequantize_groups, quantize_groups

    write_checkpoint(tmp_path, kind)
    scales = checkpoint_steps(tmp_path, kind)
    full_span = 0
    for name, weight in load_hf_folder(tmp_path).tensors.items():
        if name not in scales:
            continue
        codes, d, m = quantize_groups(weight)
        error = (dequantize_groups(codes, d, m) - weight).abs()
        offset = m.float().abs().repeat_interleave(32, 1) * 2**-10  # fp16's half ulp and more
        assert (error <= scales[name] / 2 + offset).all(), name
        # a checkpoint group whose codes span 0-15 packs with the checkpoint's own step
        spans = d.float() == scales[name][:, ::32]
        exact = spans.repeat_interleave(32, 1)
        assert (error[exact] <= offset[exact]).all(), name
        full_span += int(spans.sum())
    assert full_span > 0


def checkpoint_steps(folder, kind: str) -> dict[str, torch.Tensor]:
    """Each quantized linear's step per weight element, (out, in), from its scales."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    steps = {}
    for name, scales in tensors.items():
        if name.endswith(".scales"):
            prefix = name.removesuffix(".scales")
            rows = scales.shape[0] * GROUP
            steps[f"{prefix}.weight"] = scales.float()[torch.arange(rows) // GROUP].t()
    return steps
