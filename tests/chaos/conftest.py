"""The chaos tier: hostile requests and a hostile filesystem against real servers, each
probe beside a normal request whose latency is compared with its latency alone."""

from tests.entrypoints.openai.conftest import loaded_model  # noqa: F401 - a fixture
