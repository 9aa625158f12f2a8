"""Shared fixtures: the real default model (fetched once into the llmserve cache)."""

import os
from pathlib import Path

import pytest

from llmserve.cpu_info import set_thread_policy
from tests.engines import llm_on

set_thread_policy()  # as the CLI does, before any test imports torch (OpenMP)

# Engines in tests run eagerly: a cold torch.compile of a model takes a minute on 2 cores.
# The compiled step has its own tests (tests/models/test_compile.py), which lift this.
os.environ.setdefault("LLMSERVE_ENFORCE_EAGER", "1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1 GGUF, the default model."""
    override = os.environ.get("LLMSERVE_TEST_GGUF")
    if override:
        return Path(override)
    from llmserve.loader.catalog import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def reference_model(smollm2_gguf):
    """`transformers` on the same GGUF file, fp32: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


# The default model's weights, loaded once per kind for the whole session (a load takes
# seconds): every engine of a kind shares them through `engine_on`, each with a KV cache,
# scheduler and options of its own.


def _load(gguf: Path, quantization: str | None):
    import torch

    from llmserve.loader.model_loader import load_model

    return load_model(str(gguf), torch.float32, "cpu", quantization, enforce_eager=True)


@pytest.fixture(scope="session")
def float32_model(smollm2_gguf):
    """The exact path's weights (`dtype="float32"`)."""
    return _load(smollm2_gguf, None)


@pytest.fixture(scope="session")
def default_model(smollm2_gguf):
    """The default path's weights (`dtype="auto"`: the checkpoint's int4, or what the kernel
    choice times faster on this CPU)."""
    return _load(smollm2_gguf, "auto")


@pytest.fixture(scope="session")
def int8_model(smollm2_gguf):
    """`quantization="int8"`: W8A8 linears."""
    return _load(smollm2_gguf, "int8")


@pytest.fixture(scope="session")
def int4_a8_model(smollm2_gguf):
    """`quantization="int4-a8"`: int4 weights, 8-bit activations."""
    return _load(smollm2_gguf, "int4-a8")


@pytest.fixture(scope="session")
def smollm2_llm(float32_model):
    """llmserve's offline engine on the default model, exact fp32 path."""
    return llm_on(float32_model, kv_cache_memory="256MiB")


@pytest.fixture(scope="session")
def default_llm(default_model):
    """llmserve's offline engine on the default model, default (fast) path."""
    return llm_on(default_model, kv_cache_memory="128MiB")


@pytest.fixture(params=["generic", "avx2", "avx512", "neon"])
def kernel_level(request):
    """Runs a test with `native()` built for each instruction-set level in turn; a level this
    CPU cannot execute is skipped with the features it lacks (CI prints the skips)."""
    from llmserve import kernels

    missing = kernels.missing_features(request.param)
    if missing:
        pytest.skip(f"the {request.param} kernels need {' '.join(missing)}, which this CPU lacks")
    with kernels.using_level(request.param):
        assert kernels.native() is not None, "the native kernels must build on the test machines"
        yield request.param
