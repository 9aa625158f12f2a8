"""A fast reader of GGUF files: metadata as plain Python values, tensors as byte views.

`gguf.GGUFReader` builds a numpy view for every string of the vocabulary (about a second
per 50k tokens); this reader parses the header with `struct` over one memory map and
hands out each tensor's bytes as a zero-copy uint8 view, so opening a model takes
milliseconds. Layout (little-endian, GGUF v2/v3):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: str, type: u32, value) | tensor_count x (name: str, n_dims: u32,
    dims: u64 x n_dims, type: u32, offset: u64) | padding to `general.alignment` | data
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from llmserve.errors import ModelFormatError, ModelNotFoundError

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8), a read-only view into the file


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file; a missing, truncated or foreign file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return _Parser(buffer, path).parse()
    except ModelFormatError:
        raise
    except (struct.error, ValueError, IndexError, UnicodeDecodeError, OSError) as e:
        raise ModelFormatError(
            f"cannot read GGUF file {path}: {type(e).__name__}: {e} "
            "(is the file truncated or not a GGUF file? fetch it again)"
        ) from None


def read_metadata(file: GGUFFile) -> dict[str, Any]:
    """All key/value metadata as Python values (str, int, float, bool, or lists of them)."""
    return file.metadata


class _Parser:
    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def parse(self) -> GGUFFile:
        if self.buffer[:4] != b"GGUF":
            raise ModelFormatError(f"{self.path} is not a GGUF file (bad magic)")
        self.pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ModelFormatError(f"{self.path}: unsupported GGUF version {version}")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(num_kv):
            key = self._string()
            metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self.pos // alignment) * alignment
        tensors = [self._tensor(name, shape, qtype, start + offset)
                   for name, shape, qtype, offset in infos]
        return GGUFFile(self.path, metadata, tensors)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ValueError("string runs past the end of the file")
        text = self.buffer[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar("<I"), self._scalar("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                values = np.frombuffer(self.buffer, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self._scalar(_SCALARS[value_type])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        shape = tuple(self._scalar("<Q") for _ in range(n_dims))
        return name, shape, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, shape: tuple[int, ...], qtype: int, start: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelFormatError(f"{self.path}: unknown tensor type {qtype} in {name}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        num_bytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        if start + num_bytes > len(self.buffer):
            raise ModelFormatError(
                f"GGUF file {self.path} is truncated: tensor {name} runs past the end of the "
                "file (fetch it again)"
            )
        data = np.frombuffer(self.buffer, np.uint8, num_bytes, start)
        return GGUFTensor(name, shape, tensor_type, data)
