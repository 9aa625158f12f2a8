"""Read the metadata of a GGUF file into plain Python values."""

from pathlib import Path
from typing import Any

import gguf

from llmserve.errors import ModelFormatError, ModelNotFoundError


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped); a missing or unreadable file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors, ...
        raise ModelFormatError(
            f"cannot read GGUF file {path}: {type(e).__name__}: {e} "
            "(is the file truncated or not a GGUF file? fetch it again)"
        ) from None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values (str, int, float, bool, or lists of them)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta
