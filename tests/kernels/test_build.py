"""Which kernel level a CPU gets and how it is built: LLMSERVE_CPU_ISA, the compiler flags,
the build's cache key, and what happens without a compiler (faked platforms: milliseconds)."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from llmserve import cpu_info, kernels
from llmserve.kernels import build

ZEN3 = frozenset({"avx2", "fma", "f16c"})  # x86-64-v3, no AVX-512, no VNNI
ALDER_LAKE = ZEN3 | {"avx_vnni"}
ZEN5 = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}
OLD_X86 = frozenset({"sse4_2"})
GRAVITON = frozenset({"neon", "dotprod", "i8mm"})


@pytest.fixture
def cpu(monkeypatch):
    """Fakes this machine's architecture, system and CPU features."""
    def fake(features, arch="x86_64", system="Linux"):
        monkeypatch.setattr(cpu_info, "cpu_features", lambda: features)
        monkeypatch.setattr(cpu_info, "machine_arch", lambda: arch)
        monkeypatch.setattr(cpu_info, "is_darwin", lambda: system == "Darwin")
    return fake


@pytest.mark.parametrize("features,arch,auto,levels", [
    (ZEN3, "x86_64", "avx2", ["generic", "avx2"]),
    (ZEN5, "x86_64", "avx512", ["generic", "avx2", "avx512"]),
    (OLD_X86, "x86_64", "generic", ["generic"]),
    (GRAVITON, "aarch64", "neon", ["generic", "neon"]),
])
def test_auto_is_the_best_level_the_cpu_runs(cpu, monkeypatch, features, arch, auto, levels):
    cpu(features, arch)
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    assert kernels.supported_levels() == levels
    assert kernels.requested_level() == (auto, True)


@pytest.mark.parametrize("features,arch,system,level,extensions,flags", [
    (ZEN3, "x86_64", "Linux", "avx2", True, ["-march=x86-64-v3", "-DLLMSERVE_LEVEL_AVX2"]),
    (ALDER_LAKE, "x86_64", "Linux", "avx2", True,
     ["-march=x86-64-v3", "-mavxvnni", "-DLLMSERVE_LEVEL_AVX2"]),
    (ALDER_LAKE, "x86_64", "Linux", "avx2", False,
     ["-march=x86-64-v3", "-DLLMSERVE_LEVEL_AVX2"]),  # the baseline
    (ZEN5, "x86_64", "Linux", "avx512", True,
     ["-march=x86-64-v4", "-mavx512vnni", "-DLLMSERVE_LEVEL_AVX512"]),
    (ZEN5, "x86_64", "Linux", "generic", False, ["-march=x86-64", "-DLLMSERVE_LEVEL_GENERIC"]),
    (GRAVITON, "aarch64", "Linux", "neon", True,
     ["-march=armv8.2-a+dotprod", "-DLLMSERVE_LEVEL_NEON"]),
    (GRAVITON, "aarch64", "Linux", "neon", False, ["-march=armv8-a", "-DLLMSERVE_LEVEL_NEON"]),
    (GRAVITON, "aarch64", "Darwin", "neon", True, ["-mcpu=apple-m1", "-DLLMSERVE_LEVEL_NEON"]),
    (GRAVITON, "aarch64", "Darwin", "generic", False, ["-DLLMSERVE_LEVEL_GENERIC"]),
    (frozenset(), "riscv64", "Linux", "generic", False, ["-DLLMSERVE_LEVEL_GENERIC"]),
])
def test_compile_flags(cpu, features, arch, system, level, extensions, flags):
    cpu(features, arch, system)
    *level_flags, name = kernels.compile_flags(level, extensions)
    assert level_flags == flags
    assert name == f"-DLLMSERVE_BUILD_NAME={build.build_for(level, extensions).name}"


def test_a_named_level_builds_its_baseline(cpu, monkeypatch):
    cpu(ALDER_LAKE)
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "AVX2")
    assert kernels.requested_level() == ("avx2", False)
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "generic")
    assert kernels.requested_level() == ("generic", False)


def test_a_level_the_cpu_cannot_run_falls_back_to_auto(cpu, monkeypatch, caplog):
    cpu(ZEN3)
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx512")
    with caplog.at_level(logging.WARNING, logger="llmserve.kernels"):
        assert kernels.requested_level() == ("avx2", True)
    assert "lacks avx512f avx512bw avx512dq avx512vl" in caplog.text
    assert kernels.missing_features("neon") == ["aarch64"]


def test_an_unknown_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA must be auto or one of generic, "
                                         "avx2, avx512, neon, not 'sse9'"):
        kernels.requested_level()


def test_each_level_and_flag_set_has_its_own_build(cpu):
    cpu(ZEN5)
    paths = {build.cached_library(build.build_for(level, ext), "/usr/bin/g++")
             for level in ("generic", "avx2", "avx512") for ext in (False, True)}
    # generic, avx2 (no AVX-VNNI on this CPU: one flag set), avx512 and avx512 + VNNI
    assert len(paths) == 4
    assert all(p.name.startswith("cpu_kernels-") and p.suffix == ".so" for p in paths)


@pytest.fixture(scope="module")
def real_library() -> Path:
    """The generic level's library as this machine has it (the package's, cached or built)."""
    path, _ = build.find_library(build.build_for("generic", False))
    assert path is not None, "the native kernels must build on the test machines"
    return path


@pytest.fixture
def empty_places(monkeypatch, tmp_path):
    """No library shipped in the package, none in the cache; `library()` forgets its own."""
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "prebuilt")
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    yield tmp_path
    kernels.library.cache_clear()
    cpu_info.cache_clear()


def no_compiler(monkeypatch, places: Path) -> None:
    monkeypatch.setenv("CXX", str(places / "no-such-compiler"))
    cpu_info.cache_clear()


def test_no_library_and_no_compiler_means_torch_ops_not_a_crash(monkeypatch, caplog,
                                                                empty_places):
    no_compiler(monkeypatch, empty_places)
    with caplog.at_level(logging.WARNING, logger="llmserve.kernels"):
        assert kernels.library("generic") is None
    assert "no generic library in the package or the cache, and no C++ compiler" in caplog.text


def test_a_cached_build_is_used_without_a_compiler(monkeypatch, real_library, empty_places):
    generic = build.build_for("generic", False)
    cached = build.cached_library(generic, "/usr/bin/g++")  # in the empty cache now
    cached.parent.mkdir(parents=True)
    shutil.copy(real_library, cached)
    no_compiler(monkeypatch, empty_places)
    lib = kernels.library("generic")
    assert lib is not None and kernels.level_of(lib) == "generic"
    assert kernels.origin_of(lib) == f"cached: {cached}"


def write_prebuilt(directory: Path, library: Path, sources: str) -> Path:
    generic = build.build_for("generic", False)
    directory.mkdir(parents=True)
    shutil.copy(library, directory / build.library_name(generic))
    (directory / build.MANIFEST).write_text(json.dumps({"sources": sources,
                                                        "builds": ["generic"]}))
    return directory / build.library_name(generic)


def test_the_package_s_own_library_comes_first(monkeypatch, real_library, empty_places):
    shipped = write_prebuilt(empty_places / "prebuilt", real_library, build.sources_digest())
    no_compiler(monkeypatch, empty_places)
    lib = kernels.library("generic")
    assert lib is not None and kernels.origin_of(lib) == f"prebuilt: {shipped}"


def test_a_shipped_library_of_other_sources_is_not_used(monkeypatch, real_library,
                                                        empty_places):
    """An editable install whose kernel sources changed since the libraries were built."""
    write_prebuilt(empty_places / "prebuilt", real_library, "0" * 16)
    assert build.prebuilt_library(build.build_for("generic", False)) is None
    no_compiler(monkeypatch, empty_places)
    assert kernels.library("generic") is None  # and nothing else here: torch ops


def test_the_loaded_library_says_its_level(kernel_level):
    assert kernels.level_of(kernels.native()).split("+")[0] == kernel_level
