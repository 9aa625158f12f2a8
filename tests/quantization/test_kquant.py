"""K-quant weights (GGUF Q4_K, Q5_K, Q6_K) on their own blocks: the packed rows are the
file's values, the product is exact on the quantized activations, batching changes nothing,
and a Q4_K_M-like file runs every K-quant tensor on them (the native stack too) close to the
float32 path of the same file."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from llmserve.kernels import native
from llmserve.quantization.kquant import (
    KQuantLinearMethod,
    PackedKQuantWeight,
    RawBlocks,
    can_pack,
    kquant_linear,
    random_blocks,
)

pytestmark = pytest.mark.skipif(native() is None, reason="needs the native CPU kernels")
TYPES = (QT.Q3_K, QT.IQ4_XS, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)


def dense(parts: list[RawBlocks]) -> torch.Tensor:
    """The parts as gguf-py dequantizes them, stacked: (rows, columns) float64."""
    return torch.cat([torch.from_numpy(dequantize(p.data, p.qtype).reshape(p.rows, p.columns)
                                       .astype(np.float64)) for p in parts])


CODE_BYTES = {QT.Q3_K: slice(0, 96), QT.IQ4_XS: slice(8, 136), QT.Q4_K: slice(16, 144),
              QT.Q5_K: slice(16, 176), QT.Q6_K: slice(0, 192),
              QT.Q4_0: slice(2, 18), QT.Q4_1: slice(4, 20), QT.Q5_0: slice(2, 22),
              QT.Q5_1: slice(4, 24), QT.Q8_0: slice(2, 34)}


def term_magnitudes(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """|scaled codes| + |offset| per weight, the two terms whose difference a weight is
    (d sc u and dmin m; d sc u and 32 d sc for Q6_K): the kernel's float rounding is relative
    to them, not to their (possibly much smaller) difference. The offsets are what the
    blocks dequantize to with every code 0."""
    blocks = raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1])
    zeroed = blocks.copy()
    zeroed[..., CODE_BYTES[qtype]] = 0
    offset = np.abs(dequantize(zeroed.reshape(raw.shape), qtype).reshape(raw.shape[0], -1))
    w = np.abs(dequantize(raw, qtype).reshape(raw.shape[0], -1))
    return (w + 2 * offset).astype(np.float64)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: per row and 256 values int8 q = round(x * 127 / amax),
    times amax / 127 (llama.cpp's Q8_K), in float64."""
    groups = x.reshape(len(x), -1, 256)
    amax = groups.abs().amax(-1, keepdim=True)
    # 127 / amax divided as the kernel divides (`127 / tensor` is 127 x its reciprocal in
    # torch: two roundings, one int8 step off for about one x in a hundred)
    safe = torch.where(amax > 0, amax, 1.0)
    inv = torch.where(amax > 0, torch.full_like(safe, 127.0) / safe, 0.0)
    return ((groups * inv).round().double() * (amax / 127).double()).reshape(x.shape)


AMX = native() is not None and native().set_amx(-1) == 1


@pytest.mark.skipif(not AMX, reason="needs AMX tiles: an AMX-INT8 CPU whose kernel grants them")
@pytest.mark.parametrize("types", [*((t,) for t in TYPES), (QT.Q4_K, QT.Q4_K, QT.Q6_K)])
def test_amx_tiles_give_the_vnni_tiles_bits(types):
    """Rows in tiles of 16 on AMX (a GEMM of 32+ rows, 64+ for Q4_0 and Q4_1) get the VNNI
    tiles' bits: the same int32 sums (the K-quants' scales split into the weight bytes) and
    float epilogue."""
    generator = np.random.default_rng(3)
    rows = (48, 16, 37)[:len(types)] if len(types) > 1 else (40,)  # 40: a partial block
    parts = [random_blocks(t, r, 1024, generator) for t, r in zip(types, rows, strict=True)]
    weight = PackedKQuantWeight(parts)
    bias = torch.randn(weight.out_features)
    x = torch.randn(69, 1024)  # 64 rows on AMX, 5 on VNNI
    x[20] = 0
    x[21, 7] = 1e4  # one spike: the rest of its super-block quantizes to small codes
    try:
        native().set_amx(0)
        vnni = kquant_linear(x, weight, bias)
    finally:
        native().set_amx(1)
    amx = kquant_linear(x, weight, bias)
    assert torch.equal(amx, vnni)
    assert torch.equal(kquant_linear(x[16:48], weight, bias), amx[16:48])


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_the_files_values(qtype):
    from llmserve.quantization.kquant import KQUANT_TYPES, RECORD_BYTES

    assert RECORD_BYTES[qtype] == native().kquant_record_bytes(KQUANT_TYPES[qtype])
    parts = [random_blocks(qtype, 37, 768, np.random.default_rng(1))]
    weight = PackedKQuantWeight(parts)
    ids = torch.tensor([36, 0, 17, 16, 15])
    got = weight.embedding_rows(ids)
    assert torch.equal(got.double(), dense(parts)[ids])
    with pytest.raises(IndexError):
        weight.embedding_rows(torch.tensor([37]))


@pytest.mark.parametrize("types", [*((t,) for t in TYPES), (QT.Q4_K, QT.Q4_K, QT.Q6_K),
                                   (QT.Q4_0, QT.Q8_0, QT.Q5_1)])
def test_product_is_exact_on_the_quantized_activations(types):
    """Integer sums exact, float epilogue within rounding; a row's outputs are the same
    alone and in any batch (the int8 activations, their scales and sums are per row)."""
    generator = np.random.default_rng(2)
    rows = (48, 16, 37)[:len(types)] if len(types) > 1 else (37,)
    parts = [random_blocks(t, r, 512, generator) for t, r in zip(types, rows, strict=True)]
    assert can_pack(parts)
    weight, w = PackedKQuantWeight(parts), dense(parts)
    bias = torch.randn(weight.out_features)
    x = torch.randn(33, 512)
    x[5] = 0  # an all-zero row: a zero scale
    y = kquant_linear(x, weight, bias)
    xq = quantized_activations(x)
    ref = xq @ w.T + bias.double()
    terms = torch.from_numpy(np.concatenate([term_magnitudes(p.data, p.qtype) for p in parts]))
    bound = 1e-5 * (xq.abs() @ terms.T + bias.abs().double()) + 1e-6
    worst = ((y.double() - ref).abs() / bound).max().item()
    print(f"{'+'.join(t.name for t in types)}: worst {worst:.3f} of the 1e-5 rounding bound")
    assert worst <= 1
    for m in (1, 3, 5):
        assert torch.equal(kquant_linear(x[:m], weight, bias), y[:m])
    assert torch.equal(kquant_linear(x[7:8], weight, bias)[0], y[7])


def test_what_cannot_run_as_one_weight():
    g = np.random.default_rng(3)
    q4 = random_blocks(QT.Q4_K, 16, 512, g)
    assert not can_pack([])
    assert not can_pack([q4, RawBlocks(QT.Q2_K, np.zeros((16, 168), np.uint8), 512)])
    assert can_pack([q4, random_blocks(QT.Q8_0, 16, 512, g)])  # Q8_0 beside Q4_K
    assert not can_pack([RawBlocks(QT.Q4_0, np.zeros((16, 18 * 18), np.uint8), 576)])
    assert not can_pack([q4, random_blocks(QT.Q4_K, 16, 768, g)])  # other columns
    odd = random_blocks(QT.Q6_K, 8, 512, g)
    assert not can_pack([odd, q4])  # a type run of 8 rows before another: no 16-row record
    assert can_pack([q4, odd])


# ---- a Q4_K_M-like file end to end -------------------------------------------------------

# llama-quantize's Q4_K_M gives attn_v and ffn_down Q6_K on some layers, and the tied
# embedding Q6_K; here every layer's, so each fused q|k|v mixes types
MIX = {"attn_v.weight": QT.Q6_K, "ffn_down.weight": QT.Q6_K, "token_embd.weight": QT.Q6_K}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, smollm2_gguf):
    import transformers

    from llmserve.gguf_meta import open_gguf, read_metadata
    from tests.gguf_writer import write_gguf
    from tests.tiny_models import randomize

    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=len(tokenizer["tokenizer.ggml.tokens"]),
        max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    randomize(model)
    path = tmp_path_factory.mktemp("kquant") / "tiny.Q4_K_M.gguf"
    return write_gguf(model, path, QT.Q4_K, tokenizer, types=MIX)


@pytest.fixture(scope="module")
def kquant_models(kquant_gguf):
    from llmserve.loader.model_loader import load_model

    return load_model(str(kquant_gguf), quantization="kquant"), load_model(str(kquant_gguf))


def test_file_runs_on_its_own_blocks(kquant_gguf, kquant_models):
    from llmserve.loader.gguf import gguf_stored_quantization
    from llmserve.models.llama_native import NativeLlamaLayers

    assert gguf_stored_quantization(kquant_gguf) == "kquant"
    fast, _ = kquant_models
    model = fast.model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert isinstance(linear.method, KQuantLinearMethod)
    assert layer.self_attn.qkv_proj.method.weight.types == [QT.Q4_K, QT.Q6_K]  # q|k, then v
    assert model.lm_head.weight.types == [QT.Q6_K]  # the tied embedding's own blocks
    assert isinstance(model.native_layers, NativeLlamaLayers)


def test_follows_the_float_path_and_the_stack_equals_per_op(kquant_models):
    from tests.models.test_llama_reference import full_logits, per_op_logits

    fast, exact = kquant_models
    ids = list(range(100, 164))
    ours = full_logits(fast.model, ids)
    reference = full_logits(exact.model, ids)  # float32 on the same dequantized weights
    scale = reference.abs().max().item()
    diff = (ours - reference).abs().max().item()
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"K-quant vs float32 on the same file: max |logit diff| {diff:.3f} of max "
          f"|logit| {scale:.2f}; top-1 agrees at {agree:.0%} of 64 positions")
    assert diff <= 0.05 * scale and agree >= 0.9
    assert torch.equal(ours, per_op_logits(fast.model, ids))


def test_generation_is_batch_invariant(kquant_models):
    from llmserve import SamplingParams
    from tests.engines import llm_on

    llm = llm_on(kquant_models[0], kv_cache_memory="32MiB")
    prompts = [{"prompt_token_ids": list(range(200 + 7 * i, 230 + 11 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_matrices_on_their_blocks_are_never_dequantized(kquant_gguf, monkeypatch):
    """A file's matrices that run on their own blocks are not read as floats at load (an
    8B file would take 32 GB as float32): only the norms are."""
    from llmserve.loader import gguf as gguf_loader
    from llmserve.loader.model_loader import load_model

    read = []
    to_torch = gguf_loader.tensor_to_torch

    def recording(tensor, rows, cols):
        read.append(tensor.name)
        return to_torch(tensor, rows, cols)

    monkeypatch.setattr(gguf_loader, "tensor_to_torch", recording)
    loaded = load_model(str(kquant_gguf), quantization="kquant")
    assert loaded.quantization == "kquant"
    assert read and all(name.endswith("norm.weight") for name in read), read
    read.clear()
    load_model(str(kquant_gguf))  # the exact path reads every tensor
    assert any(name == "token_embd.weight" for name in read)
