"""The engine every structured-output test shares: the default model on the default path."""

import pytest

from llmserve import LLM
from llmserve.engine.engine import Engine
from tests.engines import engine_on


@pytest.fixture(scope="session")
def structured_engine(default_model) -> Engine:
    # no prefix caching: a batch run twice (final outputs, then deltas) computes the same
    # shapes both times, so its seeded samples are the same to the token; 512 MiB holds
    # the whole schema batch (~120 requests) at once
    return engine_on(default_model, kv_cache_memory="512MiB", enable_prefix_caching=False)


@pytest.fixture(scope="session")
def structured_llm(structured_engine) -> LLM:
    return LLM.from_engine(structured_engine)
