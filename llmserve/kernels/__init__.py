"""Native CPU kernels, built on first use for one instruction-set level.

The C++ sources (`*.cpp`, written once on `simd.h`'s 16-lane values; no torch headers) are
compiled by the system C++ compiler into the llmserve cache, one build per source, level
and compiler flags, and loaded with ctypes. The level is `LLMSERVE_CPU_ISA`:

* `auto` (the default): the best level this CPU runs, with the extensions it has
  (AVX-512 VNNI, AVX-VNNI, ARM dotprod);
* `avx512` (x86-64-v4), `avx2` (x86-64-v3), `neon` (aarch64), `generic` (plain C++): that
  level's baseline only, so any x86 machine can build, test and time what an AVX2 laptop
  or an older CPU runs. A level this CPU cannot execute is refused with the features it
  lacks, and `auto` is used instead.

Its threads are its own spin-then-sleep pool (`thread_pool.h`), sized like torch's
(`set_num_threads`); `LLMSERVE_SPIN_US` (default 1000) is how long an idle worker spins
before it sleeps. When no compiler is present (or `LLMSERVE_NATIVE_KERNELS=0`), `native()`
returns None and callers fall back to plain torch ops: slower, never wrong.
"""

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import torch

from llmserve import cpu_info
from llmserve.config.paths import cache_root
from llmserve.kernels.binding import IncompatibleLibrary, Kernels

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
DEFAULT_SPIN_US = 1000
_LOCK = threading.Lock()
_pool_size: dict[int, int] = {}  # id(library) -> threads of its current pool

# level -> the CPU features it needs (Linux names, as cpu_info reports them)
ISA_LEVELS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "neon": ("neon",),
}
_LEVEL_ARCH = {"avx2": "x86_64", "avx512": "x86_64", "neon": "aarch64"}

def cpu_flags() -> list[str]:
    """The CPU features that matter for kernel choice (x86 and ARM) this CPU has."""
    present = cpu_info.cpu_features()
    return [flag for flag in cpu_info.KERNEL_FLAGS if flag in present]


def missing_features(level: str) -> list[str]:
    """What this CPU lacks to run `level` (its architecture included); [] if it runs it."""
    arch = _LEVEL_ARCH.get(level)
    if arch is not None and cpu_info.machine_arch() != arch:
        return [arch]
    present = cpu_info.cpu_features()
    return [f for f in ISA_LEVELS[level] if f not in present]


def supported_levels() -> list[str]:
    """The levels this CPU executes, lowest first."""
    return [level for level in ISA_LEVELS if not missing_features(level)]


def auto_level() -> str:
    """The best level this CPU executes."""
    levels = supported_levels()
    return max(levels, key=lambda lv: ("generic", "neon", "avx2", "avx512").index(lv))


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
    features = cpu_info.cpu_features() if extensions else frozenset()
    if level == "avx512":
        return ["-march=x86-64-v4", *(["-mavx512vnni"] if "avx512_vnni" in features else [])]
    if level == "avx2":
        return ["-march=x86-64-v3", *(["-mavxvnni"] if "avx_vnni" in features else [])]
    if level == "neon":
        if cpu_info.is_darwin():
            return ["-mcpu=apple-m1"]  # every Apple Silicon core has dotprod
        return ["-march=armv8.2-a+dotprod" if "dotprod" in features else "-march=armv8-a"]
    arch = {"x86_64": ["-march=x86-64"], "aarch64": ["-march=armv8-a"]}
    flags = [] if cpu_info.is_darwin() else arch.get(cpu_info.machine_arch(), [])
    return [*flags, "-DLLMSERVE_FORCE_GENERIC"]


def _sources() -> list[Path]:
    return sorted(p for p in _DIR.iterdir() if p.suffix in (".cpp", ".h"))


def _build_dir() -> Path:
    return cache_root() / "kernels"


def _library_path(level: str, flags: list[str], compiler: str) -> Path:
    key = hashlib.sha256()
    for source in _sources():
        key.update(source.name.encode() + source.read_bytes())
    key.update(" ".join([compiler, *flags]).encode())
    name = f"cpu_kernels-{level}-{key.hexdigest()[:16]}{cpu_info.shared_library_suffix()}"
    return _build_dir() / name


def _compile(target: Path, compiler: str, flags: list[str]) -> None:
    """Each source to an object in parallel (one per core), then one link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off: no fused multiply-adds but the ones written (simd::fmadd), so
    # results match torch's elementwise ops and every level's lane arithmetic is the same
    common = [compiler, "-O3", "-std=c++17", "-fPIC", "-pthread", "-ffp-contract=off",
              "-DNDEBUG", *flags]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects, jobs = [], []
        for source in (p for p in _sources() if p.suffix == ".cpp"):
            obj = Path(tmp) / f"{source.stem}.o"
            objects.append(str(obj))
            jobs.append(subprocess.Popen([*common, "-c", str(source), "-o", str(obj)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True))
        for job in jobs:
            _, err = job.communicate(timeout=300)
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=err)
        partial = Path(tmp) / target.name
        link = [compiler, "-shared", "-pthread", *objects, "-o", str(partial)]
        if cpu_info.is_darwin():
            link.insert(1, "-dynamiclib")
        subprocess.run(link, check=True, capture_output=True, text=True, timeout=120)
        partial.replace(target)


@contextlib.contextmanager
def _build_lock(target: Path):
    """Held by one process at a time for `target`'s build (server workers, test workers and
    CLI commands started together build each level once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@cache
def library(level: str, extensions: bool = False) -> Kernels | None:
    """The kernel library built for `level` (see the module docstring), loaded; None when it
    cannot be built here (no compiler, a build error)."""
    compiler = cpu_info.find_compiler()
    if compiler is None:
        logger.warning("native CPU kernels unavailable (no C++ compiler; set CXX), "
                       "using torch ops")
        return None
    flags = compile_flags(level, extensions)
    with _LOCK:
        path = _library_path(level, flags, compiler)
        try:
            if not path.exists():
                with _build_lock(path):  # another process may be building it: wait for it
                    if not path.exists():
                        _compile(path, compiler, flags)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip()
            logger.warning("native CPU kernels (%s) unavailable, using torch ops: %s", level,
                           detail.splitlines()[-1] if detail else exc)
            return None
    try:
        kernels = Kernels(lib, path)
    except IncompatibleLibrary as exc:
        logger.warning("native CPU kernels unavailable, using torch ops: %s", exc)
        return None
    _start_pool(kernels, torch.get_num_threads())
    return kernels


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
