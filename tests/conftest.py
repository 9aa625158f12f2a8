"""Shared fixtures: the real default model (fetched once into the llmserve cache)."""

import os
from pathlib import Path

import pytest

from llmserve.cpu_info import set_thread_policy

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


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """llmserve's offline engine on the default model, exact fp32 path."""
    from llmserve import LLM

    return LLM(str(smollm2_gguf), dtype="float32", kv_cache_memory="256MiB")


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
