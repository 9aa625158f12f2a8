"""How the native kernels are built and found: the one table of instruction-set levels.

`BUILDS` is the only place a level is defined: the architecture it runs on, the CPU features
it needs, the compiler flags that make it (`simd.h` picks its implementation from the
`-DLLMSERVE_LEVEL_*` define among them, not from what the compiler happens to enable). The
package build (`setup.py`), the loader (`llmserve.kernels`) and the tests read it.

A library is found, in this order:

1. **prebuilt**: shipped in the installed package (`prebuilt/`, written when the wheel is
   built: every build of its platform), used when its sources are the installed ones (an
   editable install whose kernel source changed builds anew);
2. **built here**: compiled by the system C++ compiler into the llmserve cache, one build per
   sources, flags and compiler, and reused from there (found even when no compiler is
   present any more).

This module imports no torch: `setup.py` loads it by path to build the wheel's libraries.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmserve import cpu_info
from llmserve.config.paths import cache_root

logger = logging.getLogger("llmserve.kernels")

SOURCE_DIR = Path(__file__).parent
PREBUILT_DIR = SOURCE_DIR / "prebuilt"
MANIFEST = "manifest.json"
# -ffp-contract=off: no fused multiply-adds but the ones written (simd::fmadd), so results
# match torch's elementwise ops and every level's lane arithmetic is the same
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-pthread", "-ffp-contract=off", "-DNDEBUG")


@dataclass(frozen=True)
class Build:
    """One way to compile the kernels: a level, alone or with a dot-product extension."""
    name: str  # what the library reports (`llmserve_kernels_level`): "avx2+avxvnni"
    arch: str  # the machine architecture it runs on ("x86_64", "aarch64")
    flags: tuple[str, ...]  # compiler flags (Linux; macOS: see `flags_for`)
    features: tuple[str, ...] = ()  # the CPU features it needs (Linux names, as cpu_info)

    @property
    def level(self) -> str:
        return self.name.split("+")[0]

    @property
    def compiler_flags(self) -> tuple[str, ...]:
        """Its flags and its name (what `simd::level_name()` reports)."""
        return (*self.flags, f"-DLLMSERVE_BUILD_NAME={self.name}")

    @property
    def extension(self) -> str | None:
        """The CPU feature this build adds to its level's baseline, or None."""
        extra = [f for f in self.features if f not in LEVEL_FEATURES.get(self.level, ())]
        return extra[0] if extra else None


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
BUILDS: tuple[Build, ...] = (
    Build("generic", "x86_64", ("-march=x86-64", "-DLLMSERVE_LEVEL_GENERIC")),
    Build("avx2", "x86_64", ("-march=x86-64-v3", "-DLLMSERVE_LEVEL_AVX2"), _AVX2),
    Build("avx2+avxvnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni", "-DLLMSERVE_LEVEL_AVX2"),
          (*_AVX2, "avx_vnni")),
    Build("avx512", "x86_64", ("-march=x86-64-v4", "-DLLMSERVE_LEVEL_AVX512"), _AVX512),
    Build("avx512+vnni", "x86_64",
          ("-march=x86-64-v4", "-mavx512vnni", "-DLLMSERVE_LEVEL_AVX512"),
          (*_AVX512, "avx512_vnni")),
    Build("generic", "aarch64", ("-march=armv8-a", "-DLLMSERVE_LEVEL_GENERIC")),
    Build("neon", "aarch64", ("-march=armv8-a", "-DLLMSERVE_LEVEL_NEON"), ("neon",)),
    Build("neon+dotprod", "aarch64", ("-march=armv8.2-a+dotprod", "-DLLMSERVE_LEVEL_NEON"),
          ("neon", "dotprod")),
)
# level -> the CPU features it needs: its baseline build's
LEVEL_FEATURES: dict[str, tuple[str, ...]] = {}
for _build in BUILDS:
    LEVEL_FEATURES.setdefault(_build.level, _build.features)
LEVEL_ARCH = {b.level: b.arch for b in BUILDS if b.level != "generic"}


def missing_features(level: str) -> list[str]:
    """What this CPU lacks to run `level` (its architecture included); [] if it runs it."""
    arch = LEVEL_ARCH.get(level)
    if arch is not None and cpu_info.machine_arch() != arch:
        return [arch]
    present = cpu_info.cpu_features()
    return [f for f in LEVEL_FEATURES[level] if f not in present]


def build_for(level: str, extensions: bool, arch: str | None = None) -> Build:
    """The build of `level` for `arch` (this machine's): with this CPU's extension of it
    when `extensions` (as `auto` loads), else the level's baseline."""
    arch = arch or cpu_info.machine_arch()
    builds = [b for b in BUILDS if b.level == level and b.arch == arch]
    if not builds:
        builds = [b for b in BUILDS if b.level == level][:1]  # generic on another platform
    present = cpu_info.cpu_features() if extensions else frozenset()
    usable = [b for b in builds if all(f in present for f in b.features if
                                       f not in LEVEL_FEATURES[level])]
    return usable[-1]


def flags_for(build: Build) -> list[str]:
    """`build`'s compiler flags on this system (Apple's clang: -mcpu instead of -march)."""
    foreign = build.arch != cpu_info.machine_arch()  # generic on another platform
    if not (foreign or cpu_info.is_darwin() and build.level in ("generic", "neon")):
        return list(build.compiler_flags)
    flags = [f for f in build.compiler_flags if not f.startswith("-march=")]
    if build.level == "neon":
        flags.insert(0, "-mcpu=apple-m1")  # every Apple Silicon core has dotprod
    return flags


def sources(directory: Path = SOURCE_DIR) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".cpp", ".h"))


def sources_digest(directory: Path = SOURCE_DIR) -> str:
    """The kernel sources' digest: a library built from other sources is not used."""
    key = hashlib.sha256()
    for source in sources(directory):
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    return key.hexdigest()[:16]


def library_name(build: Build) -> str:
    return f"cpu_kernels-{build.name}{cpu_info.shared_library_suffix()}"


def compile_library(target: Path, compiler: str, flags: list[str],
                    source_dir: Path = SOURCE_DIR) -> None:
    """Each source (of `source_dir`) to an object in parallel, then one link; `target`
    appears whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    common = [compiler, *COMMON_FLAGS, *flags]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        jobs = []
        for source in (p for p in sources(source_dir) if p.suffix == ".cpp"):
            obj = Path(tmp) / f"{source.stem}.o"
            jobs.append((obj, subprocess.Popen([*common, "-c", str(source), "-o", str(obj)],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True)))
        for _, job in jobs:
            _, err = job.communicate(timeout=600)
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, stderr=err)
        partial = Path(tmp) / target.name
        link = [compiler, "-shared", "-pthread", *(str(obj) for obj, _ in jobs),
                "-o", str(partial)]
        if cpu_info.is_darwin():
            link.insert(1, "-dynamiclib")
        subprocess.run(link, check=True, capture_output=True, text=True, timeout=300)
        partial.replace(target)


# ---- finding a library ---------------------------------------------------------------------

def prebuilt_library(build: Build, directory: Path | None = None) -> Path | None:
    """`build`'s library as shipped in the package (`directory`: PREBUILT_DIR), if it was
    built from these sources."""
    directory = directory or PREBUILT_DIR
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    path = directory / library_name(build)
    if manifest.get("sources") != sources_digest() or build.name not in manifest.get(
            "builds", ()) or not path.exists():
        return None
    return path


def build_dir() -> Path:
    return cache_root() / "kernels"


def cached_library(build: Build, compiler: str | None) -> Path:
    """Where `build` compiled by `compiler` is kept in the cache (None: any compiler's
    build of these sources and flags, if one is there)."""
    flags_key = hashlib.sha256(" ".join(flags_for(build)).encode()).hexdigest()[:8]
    stem = f"cpu_kernels-{build.name}-{sources_digest()}-{flags_key}"
    suffix = cpu_info.shared_library_suffix()
    if compiler is None:
        return next(iter(sorted(build_dir().glob(f"{stem}-*{suffix}"))),
                    build_dir() / f"{stem}-none{suffix}")
    compiler_key = hashlib.sha256(compiler.encode()).hexdigest()[:8]
    return build_dir() / f"{stem}-{compiler_key}{suffix}"


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


def find_library(build: Build) -> tuple[Path | None, str]:
    """`build`'s library file and where it came from ("prebuilt", "cached", "built"), or
    (None, why not): the package's own first, then the cache, then the compiler."""
    path = prebuilt_library(build)
    if path is not None:
        return path, "prebuilt"
    compiler = cpu_info.find_compiler()
    compiler = shutil.which(compiler) if compiler else None  # CXX=/nonexistent: none
    path = cached_library(build, compiler)
    if path.exists():
        return path, "cached"
    if compiler is None:
        return None, (f"no {build.name} library in the package or the cache, and no C++ "
                      "compiler to build one (set CXX)")
    with _build_lock(path):  # another process may be building it: wait for it
        if not path.exists():
            compile_library(path, compiler, flags_for(build))
    return path, "built"


# ---- the package build --------------------------------------------------------------------

def prebuild(package_dir: Path, arch: str | None = None, compiler: str | None = None
             ) -> list[str]:
    """Compiles every build of `arch` (this machine's) from the kernel sources in
    `package_dir` (the package being built's `llmserve/kernels`) into its `prebuilt/`, with
    a manifest (what `prebuilt_library` reads); returns the builds made. One that fails to
    compile is left out with a warning (the installed package then builds it where a
    compiler is)."""
    arch = arch or cpu_info.machine_arch()
    compiler = compiler or cpu_info.find_compiler()
    if compiler is None:
        logger.warning("no C++ compiler: the package ships no native kernels (set CXX)")
        return []
    builds = [b for b in BUILDS if b.arch == arch]
    directory = package_dir / PREBUILT_DIR.name
    directory.mkdir(parents=True, exist_ok=True)
    digest = sources_digest(package_dir)  # what the package ships, copied before this runs

    def make(build: Build) -> str | None:
        try:
            compile_library(directory / library_name(build), compiler, flags_for(build),
                            package_dir)
            return build.name
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip()
            logger.warning("the %s kernels did not build: %s", build.name,
                           detail.splitlines()[-1] if detail else exc)
            return None

    made = [name for name in map(make, builds) if name]  # each compiles its sources in parallel
    (directory / MANIFEST).write_text(json.dumps(
        {"sources": digest, "arch": arch, "builds": made}, indent=1))
    return made
