"""Shared fixtures: the real default model (fetched once into the llmserve cache)."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1 GGUF, the default model."""
    override = os.environ.get("LLMSERVE_TEST_GGUF")
    if override:
        return Path(override)
    from llmserve.loader.catalog import fetch_model

    return fetch_model("smollm2-135m")
