"""Native CPU kernels, built on first use with the machine's own instruction set.

`cpu_kernels.cpp` (plain C++, no torch headers) is compiled by the system C++ compiler
(`-O3 -march=native`, about a second) into the llmserve cache, one build per source and
CPU-flag set, and loaded with ctypes. Its threads are its own spin-then-sleep pool
(`thread_pool.h`), sized like torch's (`set_num_threads`); `LLMSERVE_SPIN_US` (default
1000) is how long an idle worker spins before it sleeps. When no compiler is present (or
`LLMSERVE_NATIVE_KERNELS=0`), `native()` returns None and callers fall back to plain
torch ops: slower, never wrong.
"""

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_SOURCES = (_SOURCE, _SOURCE.with_name("llama_layers.cpp"), _SOURCE.with_name("thread_pool.h"))
DEFAULT_SPIN_US = 1000
_ABI = 14
_LOCK = threading.Lock()
_pool_size: dict[str, int] = {}  # threads of the kernels' current pool

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F32 = ctypes.c_float

# name -> argument types (all return void unless listed in _RESTYPES)
_SIGNATURES = {
    "llmserve_kernels_abi": [],
    "llmserve_set_num_threads": [_I32, _I64],
    "llmserve_rms_norm": [_P, _I64, _I64, _P, _F32, _P],
    "llmserve_rotary_inplace": [_P, _I64, _I64, _I64, _I64, _P, _P, _P],
    "llmserve_silu_and_mul": [_P, _I64, _I64, _P],
    "llmserve_llama_layers": [_P, _I64, _P, _P, _I64, _P, _P, _P],
    "llmserve_pack_int8_weight": [_P, _I64, _I64, _P],
    "llmserve_int8_embedding": [_P, _I64, _I64, _P, _I64, _I64, _P, _P],
    "llmserve_int8_linear": [_P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P],
    "llmserve_pack_q4_weight": [_P, _P, _P, _I64, _I64, _P],
    "llmserve_q4_linear": [_P, _I64, _I64, _P, _P, _I64, _P, _P],
    "llmserve_pack_f32_weight": [_P, _I64, _I64, _P],
    "llmserve_argmax_rows": [_P, _I64, _I64, _P],
    "llmserve_apply_token_bitmask": [_P, _I64, _P, _I64, _P],
    "llmserve_f32_linear": [_P, _I64, _I64, _P, _P, _I64, _P],
    "llmserve_f32_linear_from": [_P, _I64, _I64, _P, _P, _P, _I64, _P],
    "llmserve_kv_cache_write": [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I32],
    "llmserve_paged_attention": [
        _P, _I64, _I64, _I64, _P, _P, _P, _P, _I32, _I64, _I64, _P, _I64, _P, _P, _I64, _F32,
        _I64, _F32, _P,
    ],
}
_RESTYPES = {"llmserve_kernels_abi": _I32, "llmserve_int8_embedding": _I32}


@cache
def cpu_flags() -> list[str]:
    """The x86 feature flags that matter for kernel choice, from /proc/cpuinfo."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8")
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    present = set(line.split())
    return [flag for flag in wanted if flag in present]


def _build_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE") or Path.home() / ".cache" / "llmserve"
    return Path(root) / "kernels"


def _library_path() -> Path:
    key = hashlib.sha256()
    for source in _SOURCES:
        key.update(source.read_bytes())
    key.update(" ".join(cpu_flags()).encode())
    key.update(Path("/proc/cpuinfo").read_bytes().split(b"flags", 1)[-1][:2048]
               if Path("/proc/cpuinfo").exists() else b"")
    return _build_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _compile(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    # -ffp-contract=off: no fused multiply-adds, so results match torch's elementwise ops
    cmd = [
        os.environ.get("CXX", "g++"), "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
        "-pthread", "-ffp-contract=off", "-DNDEBUG",
        *(str(f) for f in _SOURCES if f.suffix == ".cpp"), "-o", str(tmp),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    tmp.replace(target)


@cache
def native() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (no compiler, disabled, or a build error)."""
    if os.environ.get("LLMSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    with _LOCK:
        path = _library_path()
        try:
            if not path.exists():
                _compile(path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            logger.warning("native CPU kernels unavailable, using torch ops: %s",
                           detail.strip().splitlines()[-1] if detail.strip() else exc)
            return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name)
    if lib.llmserve_kernels_abi() != _ABI:
        logger.warning("native CPU kernels: ABI mismatch, using torch ops")
        return None
    spin_us = int(os.environ.get("LLMSERVE_SPIN_US", DEFAULT_SPIN_US))
    lib.llmserve_set_num_threads(torch.get_num_threads(), spin_us)
    _pool_size["threads"] = torch.get_num_threads()
    logger.info("native CPU kernels loaded (%s)", " ".join(cpu_flags()) or "no x86 flags")
    return lib


def set_num_threads(num_threads: int) -> None:
    """Compute threads for torch's ops and for the native kernels' pool alike."""
    torch.set_num_threads(num_threads)
    lib = native()
    if lib is not None and _pool_size.get("threads") != num_threads:
        spin_us = int(os.environ.get("LLMSERVE_SPIN_US", DEFAULT_SPIN_US))
        lib.llmserve_set_num_threads(num_threads, spin_us)
        _pool_size["threads"] = num_threads


def native_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, if every tensor is a contiguous fp32 CPU tensor they can take."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return native()


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a ctypes call (None for a missing optional tensor)."""
    return None if t is None else t.data_ptr()
