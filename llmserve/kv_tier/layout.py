"""What a tier's blocks belong to: the model files, the numerics that produced their KV, and
the block's shape. Two engines share blocks only when every field matches; the fields'
hash names the tier's folder (its namespace) and stamps every block file.

A block's chain hash (`core/kv_cache_manager.hash_block`) carries its tokens, everything
before them and `cache_salt`, but not the model: the namespace adds the rest. The model is
known by a fingerprint of its files (name, size and sampled bytes), not their full hash:
a 30 GB checkpoint is not read at start-up to find its cache.
"""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# bump when the block file format or the KV numerics of a release change
FORMAT_VERSION = 1
_SAMPLE_BYTES = 1 << 16  # bytes read at each of the sampled offsets of a weight file
_NUM_SAMPLES = 16


@dataclass(frozen=True)
class TierLayout:
    """Every input that decides a block's KV bits and bytes."""

    model: str  # fingerprint of the weight files (`fingerprint_files`)
    dtype: str  # compute dtype
    quantization: str  # what the linears run ("int4", "none", ...)
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    isa: str  # the native kernels' level ("avx512+vnni"; "none" without them)
    num_threads: int  # a GEMM's split over threads may change its last bits
    attention: str  # the attention backend
    code: str  # the engine's code and torch's version (`code_fingerprint`)
    format: int = FORMAT_VERSION

    @property
    def namespace(self) -> str:
        """The folder this layout's blocks live in: a hash of every field."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_cache_dtype)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """One block's K and V for every layer: (layers, 2, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, ...] | None:
        """An int8 cache's per-(slot, head) scales of one block, float32."""
        if self.kv_cache_dtype != "int8":
            return None
        return (self.num_layers, 2, self.block_size, self.num_kv_heads)

    @property
    def data_bytes(self) -> int:
        return _numel(self.data_shape) * self.torch_kv_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """A block's payload: its data, then its scales (int8 caches)."""
        scales = self.scales_shape
        return self.data_bytes + (_numel(scales) * 4 if scales else 0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def fingerprint_files(paths: list[Path]) -> str:
    """A cheap identity of a model's files: each one's name, size and 16 sampled 64 KiB
    stretches (its first and last among them). Another file, or the same file changed in
    any sampled byte or in length, gives another fingerprint."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            last = max(size - _SAMPLE_BYTES, 0)
            offsets = sorted({last * i // (_NUM_SAMPLES - 1) for i in range(_NUM_SAMPLES)})
            for offset in offsets:
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def code_fingerprint() -> str:
    """The engine's sources (Python and kernels) and torch's version: any change to the code
    that computes KV starts a new namespace rather than trust blocks it may not reproduce."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def model_files(path: Path) -> list[Path]:
    """The files whose bytes make a model: a GGUF file; a folder's weights and configs."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin", ".gguf") or p.name.endswith("config.json")))
