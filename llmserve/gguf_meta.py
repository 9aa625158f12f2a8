"""A fast reader of GGUF files: metadata as plain Python values, tensors as byte views.

`gguf.GGUFReader` builds a numpy view for every string of the vocabulary (about a second
per 50k tokens); this reader parses the header with `struct` over one memory map and
hands out each tensor's bytes as a zero-copy uint8 view, so opening a model takes
milliseconds. Layout (little-endian, GGUF v2/v3):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key: str, type: u32, value) | tensor_count x (name: str, n_dims: u32,
    dims: u64 x n_dims, type: u32, offset: u64) | padding to `general.alignment` | data

The file is untrusted: every count and length is checked against the bytes left before
anything is allocated for it, and every tensor must lie inside the file, aligned, without
overlapping another, so a hostile header is a one-line `ModelFormatError`, never a huge
allocation.
"""

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from itertools import pairwise
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
_MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes one entry can take: a metadata pair (key length, type, a 1-byte value)
# and a tensor info (name length, n_dims, type, offset).
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


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
    """Parse a GGUF file; a missing, truncated, foreign or corrupt file is a one-line error.
    The last files parsed are kept (keyed by path, size and modification time): a start
    reads one file's header for its tokenizer, its weights and its formats, and parsing a
    128k-token vocabulary each time cost 0.15 s of it."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    stat = path.stat()
    return _parsed(path, path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: Path, resolved: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise ModelFormatError(f"{path} is empty, not a GGUF file")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelFormatError(f"cannot read GGUF file {path}: {e}") from None
    return _Parser(buffer, path).parse()


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
        version = self._scalar("<I", "the version")
        if version not in (2, 3):
            raise ModelFormatError(f"{self.path}: unsupported GGUF version {version}")
        num_tensors = self._count(self._scalar("<Q", "the tensor count"), _MIN_TENSOR_INFO_BYTES,
                                  "tensor count")
        num_kv = self._count(self._scalar("<Q", "the metadata count"), _MIN_KV_BYTES,
                             "metadata count")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string("a metadata key")
            if key in metadata:
                raise self._error(f"metadata key {key!r} appears twice")
            metadata[key] = self._value(self._scalar("<I", f"the type of {key!r}"), key)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        names = [name for name, *_ in infos]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise self._error(f"tensor {twice!r} appears twice")
        alignment = self._alignment(metadata)
        start = -(-self.pos // alignment) * alignment
        tensors = [self._tensor(*info, start, alignment) for info in infos]
        self._check_no_overlap([(offset, t.data.nbytes, t.name)
                                for (*_, offset), t in zip(infos, tensors, strict=True)])
        return GGUFFile(self.path, metadata, tensors)

    def _error(self, problem: str) -> ModelFormatError:
        return ModelFormatError(f"corrupt GGUF file {self.path}: {problem}")

    def _truncated(self, what: str) -> ModelFormatError:
        return ModelFormatError(
            f"GGUF file {self.path} is truncated: {what} at offset {self.pos} runs past the "
            f"end of the file ({len(self.buffer)} bytes; fetch it again)"
        )

    def _need(self, num_bytes: int, what: str) -> None:
        if self.pos + num_bytes > len(self.buffer):
            raise self._truncated(what)

    def _count(self, count: int, min_bytes: int, what: str) -> int:
        """`count` entries of at least `min_bytes` each must fit in the bytes left."""
        if count * min_bytes > len(self.buffer) - self.pos:
            raise ModelFormatError(
                f"GGUF file {self.path} is truncated or corrupt: {what} {count} at offset "
                f"{self.pos} cannot fit in the {len(self.buffer) - self.pos} bytes left")
        return count

    def _scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def _string(self, what: str) -> str:
        length = self._scalar("<Q", f"the length of {what}")
        self._need(length, f"{what} of {length} bytes")
        text = self.buffer[self.pos : self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def _strings(self, count: int, key: str) -> list[str]:
        """`count` strings in a row (a vocabulary: ~50k), read without a call per string
        (5x faster: the per-string calls were a tenth of a warm start)."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self._truncated(f"the length of item {i} of {key!r}")
            (length,) = unpack(buffer, pos)
            pos += 8
            if pos + length > end:
                self.pos = pos
                raise self._truncated(f"item {i} of {key!r} of {length} bytes")
            out.append(buffer[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def _value(self, value_type: int, key: str) -> Any:
        if value_type == _STRING:
            return self._string(f"the value of {key!r}")
        if value_type == _ARRAY:
            item_type = self._scalar("<I", f"the item type of {key!r}")
            count = self._scalar("<Q", f"the length of {key!r}")
            if item_type == _ARRAY:
                raise self._error(f"{key!r} is an array of arrays (not supported)")
            if item_type == _STRING:
                self._count(count, 8, f"{key!r}: string count")
                return self._strings(count, key)
            if item_type not in _NUMPY:
                raise self._error(f"{key!r} has unknown item type {item_type}")
            dtype = np.dtype(_NUMPY[item_type])
            self._need(count * dtype.itemsize, f"the {count} items of {key!r}")
            values = np.frombuffer(self.buffer, dtype, count, self.pos)
            self.pos += dtype.itemsize * count
            return values.tolist()
        if value_type not in _SCALARS:
            raise self._error(f"{key!r} has unknown value type {value_type}")
        return self._scalar(_SCALARS[value_type], f"the value of {key!r}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._scalar("<I", f"the dimension count of {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self._error(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        shape = tuple(self._scalar("<Q", f"the shape of {name!r}") for _ in range(n_dims))
        qtype = self._scalar("<I", f"the type of {name!r}")
        return name, shape, qtype, self._scalar("<Q", f"the offset of {name!r}")

    def _alignment(self, metadata: dict[str, Any]) -> int:
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
            raise self._error(f"general.alignment must be a power of two, got {alignment!r}")
        return alignment

    def _tensor(self, name: str, shape: tuple[int, ...], qtype: int, offset: int, start: int,
                alignment: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(qtype)
        except ValueError:
            raise self._error(f"unknown tensor type {qtype} in {name!r}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        if shape[0] % block_size:
            raise self._error(f"tensor {name!r}: its rows of {shape[0]} values are not whole "
                              f"{tensor_type.name} blocks of {block_size}")
        if offset % alignment:
            raise self._error(f"tensor {name!r}: data offset {offset} is not a multiple of the "
                              f"alignment {alignment}")
        num_bytes = math.prod(shape) // block_size * type_size
        if start + offset + num_bytes > len(self.buffer):
            raise ModelFormatError(
                f"GGUF file {self.path} is truncated: tensor {name!r} ({num_bytes} bytes at "
                f"offset {start + offset}) runs past the end of the file "
                f"({len(self.buffer)} bytes; fetch it again)"
            )
        data = np.frombuffer(self.buffer, np.uint8, num_bytes, start + offset)
        return GGUFTensor(name, shape, tensor_type, data)

    def _check_no_overlap(self, spans: list[tuple[int, int, str]]) -> None:
        """Each byte of data belongs to one tensor (spans: offset, size, name), so the
        weights cannot outgrow the file."""
        for (offset, size, name), (next_offset, _, next_name) in pairwise(sorted(spans)):
            if next_offset < offset + size:
                raise self._error(f"the data of tensors {name!r} and {next_name!r} overlap")
