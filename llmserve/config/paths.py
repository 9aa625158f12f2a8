"""Where llmserve keeps files on this machine."""

import os
from pathlib import Path

CACHE_ENV = "LLMSERVE_CACHE"


def cache_root(cache_dir: Path | None = None) -> Path:
    """llmserve's cache folder: `cache_dir`, else `$LLMSERVE_CACHE`, else
    `~/.cache/llmserve`. Models, kernel builds and choices, and compiled artefacts live
    under it."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmserve"
