"""Where the timed choices (kernel_choice.py, attention_choice.py) keep their decisions: one
JSON file each beside the kernel builds, keyed by the CPU, its flags, the kernel level and
sources, torch's version, the threads, the choice's own parts (shapes, formats) and the
sources that time and decide, so that a change to any of them decides again.

A decision that a busy machine made is never written: it is held for the rest of the
process (`hold_busy`), so that the engine and whatever asks after it in the same process
(`llmserve memory`'s arithmetic, a second engine) see one answer, and a later quiet start
decides for good.
"""

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from llmserve import cpu_info

logger = logging.getLogger(__name__)

# the sources whose rules time and decide, beside the kernels' own
_DECIDING = ("kernel_choice.py", "attention_choice.py", "quiet_timing.py")
_BUSY_HERE: dict[Path, Any] = {}  # cache path -> what a busy timing chose in this process


def cache_path(kind: str, parts: list[str]) -> Path:
    """Where a decision of `kind` ("choice", "attention", "prefetch") is cached."""
    from llmserve.kernels import build, level_of, native

    key = hashlib.sha256()
    for part in (cpu_info.cpu_model_name(), " ".join(sorted(cpu_info.cpu_features())),
                 level_of(native()), torch.__version__, str(torch.get_num_threads()), *parts):
        key.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for source in (*build.sources(), *(here / name for name in _DECIDING)):
        key.update(source.read_bytes())
    return build.build_dir() / f"{kind}-{key.hexdigest()[:16]}.json"


def read(path: Path) -> dict | None:
    """The decision cached at `path`; None where there is none or it cannot be read."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def busy_decision(path: Path) -> Any | None:
    """What a busy timing chose for `path` earlier in this process, if it did."""
    return _BUSY_HERE.get(path)


def hold_busy(path: Path, choice: Any) -> Any:
    """Keep `choice`, which a busy timing made, for the rest of this process; returns it."""
    _BUSY_HERE[path] = choice
    return choice


def write(path: Path, data: dict) -> None:
    """Cache a decision that a quiet machine made (it replaces one held as busy)."""
    _BUSY_HERE.pop(path, None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: choose again next time
        logger.warning("cannot cache the kernel choice in %s: %s", path, exc)
