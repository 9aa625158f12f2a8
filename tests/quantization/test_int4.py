"""The int4 path: a Q4_1 checkpoint's own weights, close to float, batch invariant (exactly)."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import native
from llmserve.loader.gguf import gguf_stored_quantization, load_gguf
from llmserve.loader.model_loader import auto_quantization
from llmserve.quantization.int4 import (
    PackedInt4Weight,
    dequantize_groups,
    int4_linear,
    packed_int4_bytes,
    quantize_groups,
)


def test_int4_linear_is_close_to_the_dequantized_weight():
    """Only the weights are 4-bit: the product follows the dequantized weight to ~15 bits."""
    torch.manual_seed(0)
    weight = torch.randn(300, 250) * 0.05  # K not a multiple of 32: zero-padded groups
    x = torch.randn(16, 250)
    x[:, 3] *= 40  # an outlier channel, as in real residual streams
    packed = PackedInt4Weight(weight)
    codes, d, m = quantize_groups(F.pad(weight, (0, packed.k_pad - 250)))
    dequantized = dequantize_groups(codes, d, m)[:, :250]
    ref = F.linear(x, dequantized)
    assert (int4_linear(x, packed) - ref).abs().max() <= 1e-3 * ref.abs().max()
    # and the 4-bit groups themselves stay within half a step of the float weight
    step = d.float().repeat_interleave(32, dim=1)[:, :250]
    assert ((dequantized - weight).abs() <= step / 2 + 1e-6).all()


def test_8_bit_activations_are_within_half_a_step():
    """int4-a8: each activation rounded to its group's 8-bit grid (amax / 127), once."""
    torch.manual_seed(0)
    weight = torch.randn(300, 256) * 0.05
    x = torch.randn(16, 256)
    x[:, 3] *= 40
    packed = PackedInt4Weight(weight, activation_bits=8)
    codes, d, m = quantize_groups(weight)
    w = dequantize_groups(codes, d, m)
    step = x.reshape(16, 8, 32).abs().amax(-1) / 127  # (rows, groups)
    bound = (step / 2) @ w.abs().reshape(300, 8, 32).sum(-1).t()
    error = (int4_linear(x, packed) - F.linear(x, w)).abs()
    assert (error <= 1.01 * bound + 1e-5).all()
    fine = (int4_linear(x, PackedInt4Weight(weight)) - F.linear(x, w)).abs()
    assert fine.max() < error.max() / 20  # 15 bits are finer by ~254x in the activations


@pytest.mark.parametrize("bits", [15, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
def test_int4_kernels_agree(rows, bits, kernel_level):
    """The native kernel (at every level) and the torch ops compute the same quantities (up to float
    summation order), with and without bias, on a partial block of 16 channels."""
    assert native() is not None, "the native kernels must build on the CPU test machines"
    torch.manual_seed(rows)
    weight = torch.randn(90, 192) * 0.1
    fast = PackedInt4Weight(weight, activation_bits=bits)
    plain = PackedInt4Weight(weight, layout="plain", activation_bits=bits)
    assert fast.layout == "vnni"
    bias = torch.randn(90)
    x = torch.randn(rows, 192)
    x[:, 7] *= 30
    ours, theirs = int4_linear(x, fast, bias), int4_linear(x, plain, bias)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


@pytest.mark.parametrize("bits", [15, 8])
def test_int4_rows_do_not_depend_on_the_batch(bits, kernel_level):
    torch.manual_seed(1)
    weight = PackedInt4Weight(torch.randn(100, 256), activation_bits=bits)
    x = torch.randn(23, 256)  # tiles of 4 rows and a remainder of 3
    together = int4_linear(x, weight)
    for i in range(23):
        assert torch.equal(int4_linear(x[i : i + 1], weight)[0], together[i])
    assert torch.equal(int4_linear(x[5:13], weight), together[5:13])


def test_q4_1_blocks_round_trip_exactly():
    """Re-quantizing dequantized Q4_1 blocks gives back their codes, scales and offsets."""
    torch.manual_seed(2)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    groups = codes.view(64, 4, 32)
    groups[:, :, 0], groups[:, :, 1] = 0, 15  # a Q4_1 block spans its min and max
    d = (torch.rand(64, 4) * 0.01 + 1e-3).half()
    m = (-torch.rand(64, 4) * 0.1).half()
    again = quantize_groups(dequantize_groups(codes, d, m))
    assert all(torch.equal(a, b) for a, b in zip(again, (codes, d, m), strict=True))


def _q4_0_weight() -> torch.Tensor:
    """Dequantized GGUF Q4_0 blocks (gguf's own quantizer), most of whose groups never reach
    code 15: min and max would give them another step."""
    import gguf
    import numpy as np

    torch.manual_seed(3)
    weight = (torch.randn(64, 256) * 0.05).numpy()
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0)
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks,
                                                            gguf.GGMLQuantizationType.Q4_0)))


def test_q4_0_blocks_run_as_stored(kernel_level):
    """A Q4_0 file's weights come back exactly (d (u - 8) as d u + m with m = -8 d), in the
    torch quantizer and the loader's native one alike (a SmolLM2-135M Q4_0 file re-quantized
    by min and max lost 20 % of perplexity)."""
    from llmserve.quantization.int4 import quantize_groups_native

    weight = _q4_0_weight()
    codes, d, m = quantize_groups(weight)
    assert torch.equal(dequantize_groups(codes, d, m), weight)
    lo, hi = torch.aminmax(weight.view(64, 8, 32), dim=-1)
    assert ((hi - lo) / 15 != d.float()).float().mean() > 0.5  # min/max alone would not
    ours = quantize_groups_native(native(), weight)
    for a, b in zip(ours, (codes, d, m), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float16 else a,
                           b.view(torch.uint8) if b.dtype == torch.float16 else b)


def test_the_default_checkpoint_runs_on_its_own_weights(smollm2_gguf):
    """Every linear weight of the default Q4_1 model is kept exactly as the file stores it."""
    assert gguf_stored_quantization(smollm2_gguf) == "int4"
    tensors = load_gguf(smollm2_gguf).tensors
    linears = [t for name, t in tensors.items() if "layers" in name and t.dim() == 2]
    assert len(linears) == 30 * 7
    for weight in linears[:21]:  # three layers' worth: the check is exact, one suffices
        assert torch.equal(dequantize_groups(*quantize_groups(weight)), weight)


def test_auto_keeps_the_checkpoint_format_where_the_kernels_run(monkeypatch):
    cpu = torch.device("cpu")
    assert native() is not None
    assert auto_quantization("int4", cpu) == "int4"
    assert auto_quantization("int8", cpu) == "int8"
    assert auto_quantization(None, cpu) is None
    assert auto_quantization("int4", torch.device("cuda")) is None
    # without the native kernels (no compiler), torch's float GEMM beats emulating them
    monkeypatch.setattr("llmserve.loader.model_loader.native", lambda: None)
    assert auto_quantization("int4", cpu) is None


def test_packed_bytes_are_five_bits_per_weight():
    weight = PackedInt4Weight(torch.randn(100, 70))  # 112 x 96 after padding
    assert weight.packed.numel() == packed_int4_bytes(100, 70) == 7 * 3 * 320
    assert packed_int4_bytes(1024, 1024) * 8 / (1024 * 1024) == 5.0


def test_native_quantization_equals_torchs(kernel_level):
    """The loader's one-pass native quantizer gives quantize_groups' codes, d and m exactly:
    random groups, constant groups (d = 0), tiny ones (subnormal halves) and large ones."""
    from llmserve.quantization.int4 import quantize_groups_native

    torch.manual_seed(0)
    weight = torch.randn(64, 256) * 0.05
    weight[3, :32] = 0.25  # a constant group
    weight[5, 32:64] *= 1e-5  # halves below 2^-14
    weight[7, 64:96] *= 1e4  # large values, (max - min) / 15 near 2^9
    weight[9] = torch.randn(256) * 1e-3 + 0.5  # offsets far from zero
    ours = quantize_groups_native(native(), weight)
    theirs = quantize_groups(weight)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float16 else a,
                           b.view(torch.uint8) if b.dtype == torch.float16 else b)
