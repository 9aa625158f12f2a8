"""What this CPU and machine are: instruction-set features, model name, architecture, memory,
how busy it is, and the C++ toolchain the native kernels are built with.

Linux answers from /proc, macOS from `sysctl`; anywhere else (Windows, a sandbox without
/proc) a question gets an empty or None answer, never an exception. Every read goes through
`read_text` and `run`, so tests fake a platform by replacing those two.

Feature names are Linux's on both architectures (`avx2`, `avx512_vnni`, `amx_int8`, ...), and
on ARM `asimd`/`asimddp` become `neon`/`dotprod`, the names macOS and compilers use.
"""

import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

# /proc/cpuinfo's aarch64 names that differ from the common ones; the rest are kept as is
_ARM_LINUX_NAMES = {"asimd": "neon", "asimddp": "dotprod"}
# macOS arm64: the feature -> the `sysctl hw.optional` keys that say 1 when present (the
# NEON key moved between macOS releases; any one of them is enough)
_ARM_DARWIN_KEYS = {
    "neon": ("hw.optional.neon", "hw.optional.AdvSIMD", "hw.optional.arm.AdvSIMD"),
    "dotprod": ("hw.optional.arm.FEAT_DotProd",),
    "i8mm": ("hw.optional.arm.FEAT_I8MM",),
    "bf16": ("hw.optional.arm.FEAT_BF16",),
}
# Intel macOS spells a few `machdep.cpu.*features` differently from Linux (lower-cased)
_X86_DARWIN_NAMES = {
    "avx1.0": "avx", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16", "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
}


# The features that decide which kernels run, in the order reports print them. x86: fp32
# (avx2/avx512f), int8 dot products (VNNI), bf16 (avx512_bf16) and Intel's matrix tiles
# (AMX); ARM: NEON, int8 dot products and matrix multiplies (dotprod, i8mm), bf16 and SVE.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8", "neon", "dotprod", "i8mm", "bf16", "sve")


def set_thread_policy() -> None:
    """Thread settings for a process that runs the engine: call it first thing, before
    torch loads OpenMP (the CLI's `main` does; importing llmserve changes nothing in
    `os.environ`). Values already in the environment win.

    OpenMP worker threads spin while waiting for work by default; on a machine with as few
    cores as threads, any other busy process (the HTTP server, a tokenizer, a benchmark
    client) then makes every parallel region wait for a descheduled spinner, and decode
    slows by 10x (measured: 1.4 vs 15 tok/s at batch 1 with a second process busy).
    Passive waiting costs little when the machine is quiet.

    numpy's OpenBLAS starts a pool of threads that poll for work; llmserve never uses numpy
    for compute, and on a small machine those threads take cycles from the kernels.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def set_thread_priority(tid: int, priority: str) -> None:
    """Thread `tid`'s CPU priority (Linux: a thread's scheduling is its own), best effort:
    where the system refuses, the thread keeps what it had.

    "idle": only CPU nothing else wants (SCHED_IDLE; else nice 19): work that may wait for
    the gaps between steps (the KV tier's writer). "low": nice 19, still a small share of a
    busy machine, so it ends under load (a request's grammar compile). "normal": back to
    the default."""
    if priority in ("idle", "normal"):
        policy = os.SCHED_IDLE if priority == "idle" else os.SCHED_OTHER
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0 if priority == "normal" else 19)
    except (AttributeError, OSError):
        pass


def read_text(path: str) -> str | None:
    """A file's text; None where it cannot be read (no /proc on this system)."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def run(cmd: list[str]) -> str | None:
    """A command's stripped stdout; None where it is missing, fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def machine_arch() -> str:
    """"x86_64" or "aarch64" (from arm64, AMD64, ...); another architecture lower-cased."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def is_darwin() -> bool:
    """macOS (Apple's toolchain: clang, .dylib, no /proc)."""
    return platform.system() == "Darwin"


def shared_library_suffix() -> str:
    """The file suffix of a shared library the C++ compiler builds here."""
    return {"Darwin": ".dylib", "Windows": ".dll"}.get(platform.system(), ".so")


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set features, Linux names (see the module docstring); empty
    where the platform does not say."""
    system = platform.system()
    if system == "Linux":
        return features_from_cpuinfo(read_text("/proc/cpuinfo") or "")
    if system == "Darwin":
        return _darwin_arm_features() if machine_arch() == "aarch64" else _darwin_x86_features()
    return frozenset()


def features_from_cpuinfo(cpuinfo: str) -> frozenset[str]:
    """The features in a /proc/cpuinfo text: its first `flags` (x86) or `Features`
    (aarch64) line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
        if key.strip() == "Features":
            return frozenset(_ARM_LINUX_NAMES.get(name, name) for name in value.split())
    return frozenset()


def _darwin_arm_features() -> frozenset[str]:
    # one `sysctl` for the whole subtree: "hw.optional.arm.FEAT_I8MM: 1" lines
    values = dict(line.split(": ", 1) for line in (run(["sysctl", "hw.optional"]) or "")
                  .splitlines() if ": " in line)
    return frozenset(feature for feature, keys in _ARM_DARWIN_KEYS.items()
                     if any(values.get(key, "").strip() == "1" for key in keys))


def _darwin_x86_features() -> frozenset[str]:
    names = []
    for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features"):
        names += (run(["sysctl", "-n", key]) or "").lower().split()
    return frozenset(_X86_DARWIN_NAMES.get(name, name) for name in names)


@functools.cache
def cpu_model_name() -> str:
    """The CPU's marketing name ("AMD EPYC 9R14 96-Core Processor", "Apple M2"), or what
    identifies it where there is none (an aarch64 part number), or "unknown"."""
    system = platform.system()
    if system == "Linux":
        name = _model_from_cpuinfo(read_text("/proc/cpuinfo") or "")
    elif system == "Darwin":
        name = run(["sysctl", "-n", "machdep.cpu.brand_string"])
    else:
        name = None
    return name or platform.processor() or "unknown"


def _model_from_cpuinfo(cpuinfo: str) -> str | None:
    # x86 has "model name"; aarch64 kernels may give a board "Hardware" line and always
    # give the core's "CPU implementer" and "CPU part" numbers
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    if fields.get("Hardware"):
        return fields["Hardware"]
    if fields.get("CPU part"):
        return (f"aarch64 CPU (implementer {fields.get('CPU implementer', '?')}, "
                f"part {fields['CPU part']})")
    return None


def memory_bytes() -> tuple[int | None, int | None]:
    """(total, available) bytes of RAM; None for a figure this system does not give.

    Not cached: what is available changes while the process runs. Sources, each filling
    what the ones before left unknown: /proc/meminfo, psutil (where installed), macOS's
    `sysctl hw.memsize` (total only), POSIX `sysconf` (available: Linux only).
    """
    total = available = None
    if platform.system() == "Linux":
        total, available = _from_meminfo(read_text("/proc/meminfo") or "")
    if total is None or available is None:
        found = _psutil_memory()
        if found is not None:
            total = found[0] if total is None else total
            available = found[1] if available is None else available
    if total is None and platform.system() == "Darwin":
        memsize = run(["sysctl", "-n", "hw.memsize"])
        total = int(memsize) if memsize and memsize.isdigit() else None
    if total is None:
        total = _sysconf_bytes("SC_PHYS_PAGES")
    if available is None:
        available = _sysconf_bytes("SC_AVPHYS_PAGES")
    return total, available


def _from_meminfo(meminfo: str) -> tuple[int | None, int | None]:
    kib = {}
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable") and value.split():
            kib[key] = int(value.split()[0])  # "MemTotal:  65842104 kB"
    return (kib["MemTotal"] * 1024 if "MemTotal" in kib else None,
            kib["MemAvailable"] * 1024 if "MemAvailable" in kib else None)


def _psutil_memory() -> tuple[int, int] | None:
    psutil = psutil_module()
    if psutil is None:
        return None
    memory = psutil.virtual_memory()
    return memory.total, memory.available


def psutil_module() -> ModuleType | None:
    """psutil where it is installed (what /proc and `sysctl` do not answer elsewhere)."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def load_average_1m() -> float | None:
    """The 1-minute load average (runnable + uninterruptible tasks); None where neither
    the OS (Windows) nor psutil gives one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        psutil = psutil_module()
        return psutil.getloadavg()[0] if psutil is not None else None


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot, its CPUs added up: user,
    nice, system, interrupts and steal (a VM's neighbours), all but idle and I/O wait. Over
    an interval, less this process's own CPU time, it is what everything else used. None
    where the system does not say (no /proc/stat and no psutil)."""
    if platform.system() == "Linux":
        busy = busy_seconds_from_stat(read_text("/proc/stat") or "", _clock_ticks())
        if busy is not None:
            return busy
    psutil = psutil_module()
    if psutil is None:
        return None
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0)
               for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def busy_seconds_from_stat(stat: str, ticks_per_s: int) -> float | None:
    """The busy seconds in a /proc/stat text: its first line, "cpu  user nice system idle
    iowait irq softirq steal guest guest_nice" in clock ticks (guest time is already in
    user)."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu" and len(fields) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, *rest = map(int, fields[1:])
            steal = rest[0] if rest else 0
            return (user + nice + system + irq + softirq + steal) / ticks_per_s
    return None


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100  # USER_HZ on every Linux architecture


def _sysconf_bytes(pages_name: str) -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages_name)
    except (AttributeError, ValueError, OSError):  # no os.sysconf (Windows), no such name
        return None


@functools.cache
def find_compiler() -> str | None:
    """The C++ compiler to build the native kernels with: $CXX if set, else the first of
    g++, c++, clang++ on PATH (clang++ first on macOS, Apple's own); None if there is none."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    names = ("clang++", "c++", "g++") if platform.system() == "Darwin" else (
        "g++", "c++", "clang++")
    return next((path for path in map(shutil.which, names) if path), None)


def cache_clear() -> None:
    """Forget what the cached functions read (tests that fake a platform call this)."""
    for function in (cpu_features, cpu_model_name, find_compiler):
        function.cache_clear()
