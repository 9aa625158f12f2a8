"""User-facing errors.

Every error a user can cause (a missing file, an unknown model name, an unsupported
architecture, an invalid parameter) is an `LLMServeError` whose message is one line that
says what went wrong and how to fix it. The CLI prints that line and exits non-zero, with
no traceback.
"""


class LLMServeError(Exception):
    """An error caused by user input or the environment, with a one-line message."""


class ModelNotFoundError(LLMServeError):
    """The model name, file or folder does not exist."""


class ModelFormatError(LLMServeError):
    """The model file exists but cannot be read (truncated, corrupt, wrong format)."""


class UnsupportedModelError(LLMServeError):
    """The model uses an architecture, tensor type or feature llmserve does not support."""


class FetchError(LLMServeError):
    """Fetching a catalog model failed."""


class RequestRejected(LLMServeError, ValueError):
    """A request that can never run (too long for the model or the cache, an input the
    model cannot take)."""
