"""Native CPU kernels for one instruction-set level, loaded with ctypes.

The C++ sources (`*.cpp`, written once on `simd.h`'s 16-lane values; no torch headers) are
built for every level of the platform when the package is built (the wheel ships them), or
else by the system C++ compiler into the llmserve cache on first use (`build.py`: the table
of levels and where a library is found), and loaded through `binding.py` (every function
declared once, typed; the ABI checked at load). The level is `LLMSERVE_CPU_ISA`:

* `auto` (the default): the best level this CPU runs, with the extensions it has
  (AVX-512 VNNI, AVX-VNNI, ARM dotprod);
* `avx512` (x86-64-v4), `avx2` (x86-64-v3), `neon` (aarch64), `generic` (plain C++): that
  level's baseline only, so any x86 machine can build, test and time what an AVX2 laptop
  or an older CPU runs. A level this CPU cannot execute is refused with the features it
  lacks, and `auto` is used instead.

Its threads are its own spin-then-sleep pool (`thread_pool.h`), sized like torch's
(`set_num_threads`); `LLMSERVE_SPIN_US` (default 1000) is how long an idle worker spins
before it sleeps. When no library can be had (none shipped or cached and no compiler, or
`LLMSERVE_NATIVE_KERNELS=0`), `native()` returns None and callers fall back to plain torch
ops: slower, never wrong.
"""

import contextlib
import ctypes
import logging
import os
import subprocess
import threading
from functools import cache

import torch

from llmserve import cpu_info
from llmserve.kernels import build
from llmserve.kernels.binding import IncompatibleLibrary, Kernels

logger = logging.getLogger(__name__)

DEFAULT_SPIN_US = 1000
_LOCK = threading.Lock()
_pool_size: dict[int, int] = {}  # id(library) -> threads of its current pool

ISA_LEVELS = build.LEVEL_FEATURES  # level -> the CPU features it needs
missing_features = build.missing_features


def cpu_flags() -> list[str]:
    """The CPU features that matter for kernel choice (x86 and ARM) this CPU has."""
    present = cpu_info.cpu_features()
    return [flag for flag in cpu_info.KERNEL_FLAGS if flag in present]


def supported_levels() -> list[str]:
    """The levels this CPU executes, lowest first."""
    return [level for level in ISA_LEVELS if not missing_features(level)]


def auto_level() -> str:
    """The best level this CPU executes."""
    levels = supported_levels()
    return levels[-1]  # BUILDS lists each platform's levels lowest first


def requested_level() -> tuple[str, bool]:
    """(level, with this CPU's extensions) from LLMSERVE_CPU_ISA."""
    name = os.environ.get("LLMSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if name == "auto":
        return auto_level(), True
    if name not in ISA_LEVELS:
        raise ValueError(f"LLMSERVE_CPU_ISA must be auto or one of {', '.join(ISA_LEVELS)}, "
                         f"not {name!r}")
    missing = missing_features(name)
    if missing:
        logger.warning("LLMSERVE_CPU_ISA=%s: this CPU lacks %s; using auto (%s)", name,
                       " ".join(missing), auto_level())
        return auto_level(), True
    return name, False


def compile_flags(level: str, extensions: bool) -> list[str]:
    """The compiler flags that build `level`; `extensions`: also this CPU's extensions of it
    (dot-product instructions), as `auto` builds."""
    return build.flags_for(build.build_for(level, extensions))


@cache
def library(level: str, extensions: bool = False) -> Kernels | None:
    """The kernel library for `level` (see the module docstring), loaded; None when there is
    none here (none shipped or cached and no compiler, a build error)."""
    chosen = build.build_for(level, extensions)
    with _LOCK:
        try:
            path, origin = build.find_library(chosen)
            if path is None:
                logger.warning("native CPU kernels unavailable, using torch ops: %s", origin)
                return None
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip()
            logger.warning("native CPU kernels (%s) unavailable, using torch ops: %s",
                           chosen.name, detail.splitlines()[-1] if detail else exc)
            return None
    try:
        kernels = Kernels(lib, path)
    except IncompatibleLibrary as exc:
        logger.warning("native CPU kernels unavailable, using torch ops: %s", exc)
        return None
    kernels.origin = origin
    _start_pool(kernels, torch.get_num_threads())
    return kernels


def origin_of(lib: Kernels) -> str:
    """Where a loaded library's file came from ("prebuilt", "cached" or "built"): its path."""
    return f"{lib.origin}: {lib.path}"


def level_of(lib: Kernels) -> str:
    """The level a loaded library was built for, with its extensions ("avx512+vnni")."""
    return lib.kernels_level().decode()


@cache
def native() -> Kernels | None:
    """The kernels at the requested level (LLMSERVE_CPU_ISA), or None (no compiler,
    disabled, or a build error)."""
    if os.environ.get("LLMSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    level, extensions = requested_level()
    lib = library(level, extensions)
    if lib is not None:
        logger.info("native CPU kernels loaded: %s (CPU: %s)", level_of(lib),
                    " ".join(cpu_flags()) or "no known features")
    return lib


@contextlib.contextmanager
def using_level(level: str):
    """Within the block, `native()` is the library built for `level` (that level's baseline,
    as LLMSERVE_CPU_ISA=level gives): how tests run the same code at every level in one
    process. Packed weights are the same at every level; objects that keep the library they
    were built with (a loaded model's native stack) keep their level."""
    missing = missing_features(level)
    if missing:
        raise ValueError(f"this CPU cannot run the {level} kernels: it lacks {' '.join(missing)}")
    saved = os.environ.get("LLMSERVE_CPU_ISA")
    os.environ["LLMSERVE_CPU_ISA"] = level
    native.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LLMSERVE_CPU_ISA", None)
        else:
            os.environ["LLMSERVE_CPU_ISA"] = saved
        native.cache_clear()


def _start_pool(lib: Kernels, num_threads: int) -> None:
    spin_us = int(os.environ.get("LLMSERVE_SPIN_US", DEFAULT_SPIN_US))
    lib.set_num_threads(num_threads, spin_us)
    _pool_size[id(lib)] = num_threads


def set_num_threads(num_threads: int) -> None:
    """Compute threads for torch's ops and for the native kernels' pool alike."""
    torch.set_num_threads(num_threads)
    lib = native()
    if lib is not None and _pool_size.get(id(lib)) != num_threads:
        _start_pool(lib, num_threads)


def native_for(*tensors: torch.Tensor) -> Kernels | None:
    """The kernels, if every tensor is a contiguous fp32 CPU tensor they can take."""
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return None
    return native()


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a ctypes call (None for a missing optional tensor)."""
    return None if t is None else t.data_ptr()
