"""`cpu_info` on each platform, faked: Linux x86 and aarch64 read /proc, macOS arm64 and x86
run `sysctl`, Windows and a system with nothing readable answer empty or None, never raise."""

import os
import platform
import shutil
from pathlib import Path

import pytest

from llmserve import cpu_info

LINUX_X86_FEATURES = {"fpu", "sse2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                      "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
LINUX_X86_CPUINFO = f"""processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: {" ".join(sorted(LINUX_X86_FEATURES))}
vmx flags\t: vnmi preemption_timer
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2
"""

LINUX_ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes crc32 atomics asimddp sve i8mm bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""

MEMINFO = """MemTotal:       65842104 kB
MemFree:         1234567 kB
MemAvailable:   40000000 kB
"""

# `sysctl hw.optional` on an M2 (macOS 14); an M1 has neither FEAT_BF16 nor FEAT_I8MM
DARWIN_ARM_OPTIONAL = """hw.optional.arm.FEAT_SME: 0
hw.optional.arm.FEAT_BF16: 1
hw.optional.arm.FEAT_I8MM: 1
hw.optional.arm.FEAT_DotProd: 1
hw.optional.arm.AdvSIMD: 1
hw.optional.floatingpoint: 1
hw.optional.arm64: 1"""
M1_OPTIONAL = """hw.optional.neon: 1
hw.optional.arm.FEAT_BF16: 0
hw.optional.arm.FEAT_I8MM: 0
hw.optional.arm.FEAT_DotProd: 1"""


@pytest.fixture(autouse=True)
def fresh_cache():
    cpu_info.cache_clear()
    yield
    cpu_info.cache_clear()


def fake_platform(monkeypatch, system: str, machine: str, files: dict[str, str] | None = None,
                  commands: dict[str, str] | None = None, on_path: tuple[str, ...] = (),
                  processor: str = "") -> None:
    """`system`/`machine` as `platform` says them; only `files` readable, only `commands`
    answering (keyed by the command line), `on_path` the compilers in /usr/bin, no psutil,
    no sysconf."""
    files, commands = files or {}, commands or {}
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "processor", lambda: processor)
    monkeypatch.setattr(cpu_info, "read_text", files.get)
    monkeypatch.setattr(cpu_info, "run", lambda cmd: commands.get(" ".join(cmd)))
    monkeypatch.setattr(cpu_info, "_psutil_memory", lambda: None)
    monkeypatch.setattr(cpu_info, "psutil_module", lambda: None)
    monkeypatch.setattr(cpu_info, "_sysconf_bytes", lambda name: None)
    monkeypatch.setattr(shutil, "which",
                        lambda name: f"/usr/bin/{name}" if name in on_path else None)
    monkeypatch.delenv("CXX", raising=False)


def test_linux_x86(monkeypatch):
    fake_platform(monkeypatch, "Linux", "x86_64",
                  files={"/proc/cpuinfo": LINUX_X86_CPUINFO, "/proc/meminfo": MEMINFO},
                  on_path=("c++", "g++", "clang++"))
    assert cpu_info.cpu_features() == LINUX_X86_FEATURES  # the first "flags" line only
    assert cpu_info.cpu_model_name() == "Intel(R) Xeon(R) Platinum 8488C"
    assert cpu_info.machine_arch() == "x86_64"
    assert cpu_info.memory_bytes() == (65842104 * 1024, 40000000 * 1024)
    assert cpu_info.find_compiler() == "/usr/bin/g++"
    assert cpu_info.shared_library_suffix() == ".so"


def test_the_machines_busy_time_from_proc_stat(monkeypatch):
    stat = ("cpu  6212068 12865 536122 1717857 30718 0 6482 23774 0 0\n"
            "cpu0 3106034 6432 268061 858928 15359 0 3241 11887 0 0\nintr 12345\n")
    fake_platform(monkeypatch, "Linux", "x86_64", files={"/proc/stat": stat})
    # user, nice, system, irq, softirq and steal (a VM's neighbours); not idle, I/O wait,
    # nor guest (already in user)
    busy = 6212068 + 12865 + 536122 + 0 + 6482 + 23774
    assert cpu_info.busy_cpu_seconds() == pytest.approx(busy / os.sysconf("SC_CLK_TCK"))
    # an old kernel's line without steal
    assert cpu_info.busy_seconds_from_stat("cpu  10 0 5 100 3 1 1\n", 100) == 0.17
    assert cpu_info.busy_seconds_from_stat("intr 1\n", 100) is None


def test_linux_aarch64(monkeypatch):
    fake_platform(monkeypatch, "Linux", "aarch64", files={"/proc/cpuinfo": LINUX_ARM_CPUINFO},
                  on_path=("clang++",))
    assert cpu_info.cpu_features() == {"fp", "neon", "evtstrm", "aes", "crc32", "atomics",
                                       "dotprod", "sve", "i8mm", "bf16"}
    assert cpu_info.cpu_model_name() == "aarch64 CPU (implementer 0x41, part 0xd40)"
    assert cpu_info.machine_arch() == "aarch64"
    assert cpu_info.find_compiler() == "/usr/bin/clang++"


def test_linux_aarch64_board_name_before_the_part_number(monkeypatch):
    fake_platform(monkeypatch, "Linux", "aarch64",
                  files={"/proc/cpuinfo": LINUX_ARM_CPUINFO + "Hardware\t: BCM2835\n"})
    assert cpu_info.cpu_model_name() == "BCM2835"


def test_macos_arm64(monkeypatch):
    fake_platform(monkeypatch, "Darwin", "arm64", commands={
        "sysctl hw.optional": DARWIN_ARM_OPTIONAL,
        "sysctl -n machdep.cpu.brand_string": "Apple M2",
        "sysctl -n hw.memsize": "17179869184",
    }, on_path=("g++", "c++", "clang++"))
    assert cpu_info.cpu_features() == {"neon", "dotprod", "i8mm", "bf16"}
    assert cpu_info.cpu_model_name() == "Apple M2"
    assert cpu_info.machine_arch() == "aarch64"
    assert cpu_info.memory_bytes() == (17179869184, None)  # available: psutil only
    assert cpu_info.find_compiler() == "/usr/bin/clang++"
    assert cpu_info.shared_library_suffix() == ".dylib"


def test_macos_m1_has_neither_bf16_nor_i8mm(monkeypatch):
    fake_platform(monkeypatch, "Darwin", "arm64", commands={"sysctl hw.optional": M1_OPTIONAL})
    assert cpu_info.cpu_features() == {"neon", "dotprod"}


def test_macos_x86_names_follow_linux(monkeypatch):
    fake_platform(monkeypatch, "Darwin", "x86_64", commands={
        "sysctl -n machdep.cpu.features": "FPU SSE2 SSE4.1 SSE4.2 AVX1.0 F16C FMA",
        "sysctl -n machdep.cpu.leaf7_features": "BMI1 AVX2 AVX512F AVX512BW AVX512VL AVX512VNNI",
        "sysctl -n machdep.cpu.brand_string": "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz",
    })
    assert cpu_info.cpu_features() == {"fpu", "sse2", "sse4_1", "sse4_2", "avx", "f16c", "fma",
                                       "bmi1", "avx2", "avx512f", "avx512bw", "avx512vl",
                                       "avx512_vnni"}
    assert cpu_info.cpu_model_name() == "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz"
    assert cpu_info.find_compiler() is None


def test_windows(monkeypatch):
    processor = "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel"
    fake_platform(monkeypatch, "Windows", "AMD64", processor=processor, on_path=("clang++",))
    assert cpu_info.cpu_features() == frozenset()
    assert cpu_info.cpu_model_name() == processor
    assert cpu_info.machine_arch() == "x86_64"
    assert cpu_info.memory_bytes() == (None, None)
    assert cpu_info.busy_cpu_seconds() is None
    assert cpu_info.shared_library_suffix() == ".dll"
    monkeypatch.setattr(cpu_info, "_psutil_memory", lambda: (32 * 2**30, 20 * 2**30))
    assert cpu_info.memory_bytes() == (32 * 2**30, 20 * 2**30)


@pytest.mark.parametrize("system", ["Linux", "Darwin", "FreeBSD"])
def test_nothing_readable_is_empty_not_an_error(monkeypatch, system):
    fake_platform(monkeypatch, system, "arm64")
    assert cpu_info.cpu_features() == frozenset()
    assert cpu_info.cpu_model_name() == "unknown"
    assert cpu_info.memory_bytes() == (None, None)
    assert cpu_info.busy_cpu_seconds() is None
    assert cpu_info.find_compiler() is None


def test_meminfo_without_memavailable_falls_back_to_sysconf(monkeypatch):
    fake_platform(monkeypatch, "Linux", "x86_64",
                  files={"/proc/meminfo": "MemTotal:  1000 kB\nMemFree:  300 kB\n"})
    monkeypatch.setattr(cpu_info, "_sysconf_bytes",
                        lambda name: {"SC_AVPHYS_PAGES": 75 * 4096}.get(name))
    assert cpu_info.memory_bytes() == (1000 * 1024, 75 * 4096)


def test_cxx_wins_and_the_answer_is_cached_until_cleared(monkeypatch):
    fake_platform(monkeypatch, "Linux", "x86_64", on_path=("g++",))
    monkeypatch.setenv("CXX", "clang++-18")
    assert cpu_info.find_compiler() == "clang++-18"
    monkeypatch.delenv("CXX")
    assert cpu_info.find_compiler() == "clang++-18"
    cpu_info.cache_clear()
    assert cpu_info.find_compiler() == "/usr/bin/g++"


def test_real_helpers_answer_none_for_what_is_not_there(tmp_path):
    assert cpu_info.read_text(str(tmp_path / "missing")) is None
    assert cpu_info.run(["llmserve-no-such-command"]) is None
    assert cpu_info.run(["false"]) is None
    assert cpu_info.run(["echo", " hi "]) == "hi"


def test_this_linux_machine_reports_its_avx2():
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), []) if cpuinfo.exists() else []
    if "avx2" not in flags:
        pytest.skip("needs Linux on a CPU whose /proc/cpuinfo flags list avx2")
    assert "avx2" in cpu_info.cpu_features()
    assert cpu_info.cpu_features() == set(flags)
    assert cpu_info.memory_bytes()[0] == int(
        next(line for line in Path("/proc/meminfo").read_text().splitlines()
             if line.startswith("MemTotal:")).split()[1]) * 1024
