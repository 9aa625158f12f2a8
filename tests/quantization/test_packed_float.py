"""The exact path's native float32 GEMM: torch's values up to summation order, rows
independent of the batch, and the whole stack as one call on the default model."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.quantization.packed_float import PackedFloatWeight, float_linear, packed_float_bytes


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_float_linear_equals_torch_up_to_rounding(rows, kernel_level):
    torch.manual_seed(rows)
    weight = torch.randn(90, 200)  # 90 channels: a partial block of 16
    bias = torch.randn(90)
    x = torch.randn(rows, 200)
    ours = float_linear(x, PackedFloatWeight(weight), bias)
    ref = F.linear(x, weight, bias)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_float_linear_rows_do_not_depend_on_the_batch(kernel_level):
    torch.manual_seed(1)
    weight = PackedFloatWeight(torch.randn(100, 256))
    x = torch.randn(23, 256)
    together = float_linear(x, weight)
    for i in range(23):
        assert torch.equal(float_linear(x[i : i + 1], weight)[0], together[i])


def test_packed_rows_are_the_weight_rows():
    weight = torch.randn(50, 33)
    packed = PackedFloatWeight(weight)
    ids = torch.tensor([0, 15, 16, 49, 3])
    assert torch.equal(packed.rows(ids), weight[ids])
    assert packed.packed.numel() * 4 == packed_float_bytes(50, 33) == 64 * 33 * 4


def test_the_exact_path_runs_the_packed_stack(smollm2_llm):
    """dtype="float32" on the CPU: packed float32 linears and head, one native call per
    step (the reference tests in test_llama_reference.py check its logits and tokens)."""
    from llmserve.layers.linear import PackedHead
    from llmserve.quantization.packed_float import PackedFloatLinearMethod

    model = smollm2_llm.engine.loaded.model
    assert model.native_layers is not None
    assert isinstance(model.lm_head, PackedHead)
    assert isinstance(model.model.layers[0].mlp.down_proj.method, PackedFloatLinearMethod)
