"""A router in front of two fake backends (tests/router/fake_backend.py), all in threads."""

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from llmserve.router.replicas import Replica
from tests.router.fake_backend import FakeBackend, serve_in_thread
from tests.router.helpers import RunningRouter, run_router


@pytest.fixture
def router() -> Iterator[RunningRouter]:
    """A router in front of two in-thread fake backends, "replica-0" and "replica-1"."""
    with ExitStack() as stack:
        backends = [FakeBackend(f"replica-{i}", prefix_hits=3 + 2 * i) for i in range(2)]
        urls = [stack.enter_context(serve_in_thread(b.app)) for b in backends]
        url = stack.enter_context(run_router([Replica(i, u) for i, u in enumerate(urls)]))
        yield RunningRouter(url, backends, urls)
