"""The CPU KV budget's free memory (`engine/loading.py`): what `cpu_info.memory_bytes` says
is available, and a message naming the fix where the system does not say (no /proc/meminfo,
no psutil)."""

import pytest
import torch

from llmserve.engine import loading as engine
from llmserve.errors import LLMServeError


def test_cpu_free_memory_is_what_is_available(monkeypatch):
    monkeypatch.setattr(engine, "memory_bytes", lambda: (64 * 2**30, 40 * 2**30))
    assert engine.free_memory_bytes(torch.device("cpu")) == 40 * 2**30


def test_unknown_free_memory_asks_for_a_size(monkeypatch):
    monkeypatch.setattr(engine, "memory_bytes", lambda: (64 * 2**30, None))
    with pytest.raises(LLMServeError, match="--kv-cache-memory .* as a size such as 4GiB"):
        engine.free_memory_bytes(torch.device("cpu"))
