"""Which kernel level a CPU gets and how it is built: LLMSERVE_CPU_ISA, the compiler flags,
the build's cache key, and what happens without a compiler (faked platforms: milliseconds)."""

import logging

import pytest

from llmserve import cpu_info, kernels

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
    (ZEN3, "x86_64", "Linux", "avx2", True, ["-march=x86-64-v3"]),
    (ALDER_LAKE, "x86_64", "Linux", "avx2", True, ["-march=x86-64-v3", "-mavxvnni"]),
    (ALDER_LAKE, "x86_64", "Linux", "avx2", False, ["-march=x86-64-v3"]),  # the baseline
    (ZEN5, "x86_64", "Linux", "avx512", True, ["-march=x86-64-v4", "-mavx512vnni"]),
    (ZEN5, "x86_64", "Linux", "generic", False, ["-march=x86-64", "-DLLMSERVE_FORCE_GENERIC"]),
    (GRAVITON, "aarch64", "Linux", "neon", True, ["-march=armv8.2-a+dotprod"]),
    (GRAVITON, "aarch64", "Linux", "neon", False, ["-march=armv8-a"]),
    (GRAVITON, "aarch64", "Darwin", "neon", True, ["-mcpu=apple-m1"]),
    (GRAVITON, "aarch64", "Darwin", "generic", False, ["-DLLMSERVE_FORCE_GENERIC"]),
])
def test_compile_flags(cpu, features, arch, system, level, extensions, flags):
    cpu(features, arch, system)
    assert kernels.compile_flags(level, extensions) == flags


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
    paths = {kernels._library_path(level, kernels.compile_flags(level, ext), "g++")
             for level in ("generic", "avx2", "avx512") for ext in (False, True)}
    # generic, avx2 (no AVX-VNNI on this CPU: one flag set), avx512 and avx512 + VNNI
    assert len(paths) == 4
    assert all(p.name.startswith("cpu_kernels-") and p.suffix == ".so" for p in paths)


def test_no_compiler_means_torch_ops_not_a_crash(monkeypatch, caplog):
    monkeypatch.setattr(cpu_info, "find_compiler", lambda: None)
    kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="llmserve.kernels"):
            assert kernels.library("generic") is None
        assert "no C++ compiler" in caplog.text
    finally:
        kernels.library.cache_clear()


def test_the_loaded_library_says_its_level(kernel_level):
    assert kernels.level_of(kernels.native()).split("+")[0] == kernel_level
