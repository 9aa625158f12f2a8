"""How commands write what they found: sizes for people, JSON result files."""

import json
from pathlib import Path
from typing import Any

from llmserve.errors import LLMServeError


def format_bytes(num: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:,.0f} {unit}" if unit == "bytes" else f"{num:,.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def write_json(path: str, data: Any) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise LLMServeError(f"cannot write {path}: {e.strerror or e}") from None
