"""The native kernels give the same bits at every instruction-set level, and the right ones.

kernel_check.cpp runs every exported kernel on fixed pseudo-random inputs and writes inputs
and outputs as blobs. It is built here at each level this machine can run: on x86-64
generic, avx2, avx2+avxvnni, avx512, avx512+vnni (those the CPU has), and aarch64's neon,
neon+dotprod and generic, cross-compiled and run under qemu-user. Every level's blobs are
compared with the generic level's, bit for bit (simd.h's design: the same lane arithmetic
and one sum tree everywhere), and with numpy references, so the check cannot pass when all
levels are equally wrong.

The baseline is the generic level built with fused multiply-adds (`-mfma`): simd.h's generic
branch, its semantic reference, fuses them wherever the CPU has them, and the plain x86-64
build (no FMA: std::fma would be a library call) multiplies and adds in two roundings.

The aarch64 tools (`aarch64-linux-gnu-g++`, `qemu-aarch64`; .ci/run installs them) missing,
those levels skip on a developer's machine and fail in CI (CI set).

Each level's check binary is kept under the llmserve cache (`kernel-checks/`), keyed by
every kernel source, the check program, the flags and the compiler version: a rerun with
nothing changed runs the binaries without building them (18 s of the suite's time at the
avx2 level otherwise); any change builds anew.
"""

import hashlib
import os
import platform
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve import cpu_info
from llmserve.config.paths import cache_root
from llmserve.kernels.build import BUILDS

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "llmserve" / "kernels"
CHECK_SOURCE = Path(__file__).with_name("kernel_check.cpp")
KERNEL_SOURCES = [KERNELS / f"{name}.cpp"
                  for name in ("kernels_api", "gemm_int8", "gemm_q4", "gemm_kquant",
                               "gemm_kquant_amx", "gemm_f32", "attention", "elementwise",
                               "llama_layers", "lora", "moe")]
CXXFLAGS = ["-O2", "-std=c++17", "-pthread", "-ffp-contract=off"]
CROSS_CXX, QEMU, AARCH64_ROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
HOST = platform.machine()
@dataclass(frozen=True)
class Level:
    id: str
    name: str  # what llmserve_kernels_level() reports
    arch: str  # "x86_64" or "aarch64"
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...] = ()  # the CPU features (cpu_info's names) a native run needs
    fused: bool = True  # simd::fmadd rounds once


def _levels() -> list[Level]:
    """The package's builds (its one table of levels, build.BUILDS), and the baseline:
    x86-64's generic level with fused multiply-adds."""
    levels = [Level(f"{b.arch}-{b.name}", b.name, b.arch, b.compiler_flags, b.features,
                    fused=b.arch != "x86_64" or b.level != "generic") for b in BUILDS]
    x86_generic = next(lv for lv in levels if lv.id == "x86_64-generic")
    fused = Level("x86_64-generic+fma", "generic", "x86_64", (*x86_generic.flags, "-mfma"),
                  ("fma",))
    return [fused, *levels]


LEVELS = _levels()
BASELINE = next((lv for lv in LEVELS if lv.name == "generic" and lv.arch == HOST and lv.fused),
                None)
if BASELINE is None:
    pytest.skip(f"no kernel levels for a {HOST} host", allow_module_level=True)
# the outputs of kernels built on simd::fmadd (the others: rotary, int8 GEMM, argmax,
# bitmask, KV-cache writes)
FUSED_OUTPUTS = re.compile(r"(rms_norm|silu|gelu|f32_linear|f32_linear_from|q4_linear|q4_linear_a8|"
                           r"kquant_linear|legacy_linear|q8_linear|q3_linear|iq4_linear|"
                           r"attention)\..*"
                           r"\.(out|y)")


def tolerated(level: Level, name: str) -> str | None:
    """Why blob `name` of `level` may differ from the baseline's in its last bits, or None.

    Such blobs are compared within 1e-5 of their largest magnitude instead.
    """
    if not level.fused and FUSED_OUTPUTS.fullmatch(name):
        return "generic on x86-64 without FMA multiplies and adds in two roundings"
    if not (name.startswith("attention.") and name.endswith(".out")):
        return None
    head_size = int(re.search(r"\.D(\d+)\.", name).group(1))
    if level.name.startswith(("avx512", "avx2")) and head_size % 16 == 0:
        return ("avx512's and avx2's attention scores sum a key's lanes in their own "
                "transpose-and-add trees (16 lanes; 8 lanes of horizontal adds)")
    if ".softcap." in name and level.arch != BASELINE.arch:
        # attention.cpp's softcap is std::tanh, outside simd.h: glibc's tanhf gives another
        # last bit on aarch64 than on x86-64 for some inputs (178 of 1.6M in [-8, 8])
        return "softcap is the platform libm's tanhf, which differs between x86-64 and aarch64"
    return None


# ---- building and running the check at each level --------------------------------------------

class Unavailable(Exception):
    """A level this machine cannot build or run; `tool_missing`: fails in CI instead."""

    def __init__(self, reason: str, tool_missing: bool = False):
        super().__init__(reason)
        self.tool_missing = tool_missing


class Broken(Exception):
    """A level whose build or run failed: its tests fail."""


@dataclass
class Run:
    level_reported: str
    blobs: dict[str, np.ndarray]
    raw: dict[str, bytes]


def compiler(arch: str) -> tuple[str, list[str]]:
    """The C++ compiler for `arch` and the command prefix that runs its programs here."""
    if arch == HOST:
        cxx = cpu_info.find_compiler()
        if cxx is None or shutil.which(cxx) is None:
            raise Unavailable("no C++ compiler here (an installed wheel's kernels are checked "
                              "by the tests that load them)")
        return cxx, []
    if arch == "aarch64" and HOST == "x86_64":
        missing = [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]
        if missing:
            raise Unavailable(f"{' and '.join(missing)} not installed (apt-get install "
                              "g++-aarch64-linux-gnu qemu-user)", tool_missing=True)
        return CROSS_CXX, [QEMU, "-L", AARCH64_ROOT]
    raise Unavailable(f"{arch} levels do not run on a {HOST} host")


def check_cpu(level: Level) -> None:
    present = cpu_info.cpu_features()
    missing = [f for f in level.cpu_flags if f not in present] if level.arch == HOST else []
    if missing:
        raise Unavailable(f"this CPU lacks {' '.join(missing)}")


DTYPES = {"f32": np.float32, "i64": np.int64, "i32": np.int32, "i8": np.int8, "u8": np.uint8,
          "u16": np.uint16}


def read_blobs(out: Path) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
    blobs, raw = {}, {}
    for line in (out / "index.txt").read_text().splitlines():
        name, dtype, dims = line.split()
        raw[name] = (out / f"{name}.bin").read_bytes()
        shape = tuple(int(d) for d in dims.split(","))
        blobs[name] = np.frombuffer(raw[name], dtype=DTYPES[dtype]).reshape(shape)
    return blobs, raw


def compile_cxx(what: str, arch: str, args: list[str]) -> None:
    cxx, _ = compiler(arch)
    build = subprocess.run([cxx, *CXXFLAGS, *args], capture_output=True, text=True, timeout=300)
    if build.returncode != 0:
        raise Broken(f"{what}: build failed\n{build.stderr[-4000:]}")


def cached_build(level: Level) -> Path:
    """Where `level`'s check binary is kept between runs: keyed by every kernel source and
    header, the check program, the flags and the compiler's version (as the package keys
    its own kernel builds), so any change builds anew."""
    cxx, _ = compiler(level.arch)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(version.encode())
    for path in sorted([CHECK_SOURCE, *KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join([*CXXFLAGS, *level.flags, level.arch]).encode())
    return cache_root() / "kernel-checks" / f"{level.id}-{digest.hexdigest()[:16]}"


def build_and_run(level: Level, check_object, work: Path) -> Run:
    """`level`'s kernels linked with the (level-independent) check program, run; the binary
    from an earlier run when nothing it is built from changed."""
    _, runner = compiler(level.arch)
    binary, out, unity = cached_build(level), work / "out", work / "kernels.cpp"
    out.mkdir(parents=True)
    if not binary.is_file():
        # the kernel sources as one translation unit: each source's headers parsed once,
        # half the compile time of seven (the same code; no source relies on its own unit)
        unity.write_text("".join(f'#include "{source}"\n' for source in KERNEL_SOURCES))
        built = work / "kernel_check"
        compile_cxx(level.id, level.arch,
                    [*level.flags, str(check_object()), str(unity), "-o", str(built)])
        binary.parent.mkdir(parents=True, exist_ok=True)
        staged = binary.with_name(f"{binary.name}.{os.getpid()}")
        shutil.copy2(built, staged)
        os.replace(staged, binary)  # whole or absent, for a run beside this one
    run = subprocess.run([*runner, str(binary), str(out)], capture_output=True, text=True,
                         timeout=120)
    if run.returncode != 0:
        raise Broken(f"{level.id}: kernel_check exited {run.returncode}\n{run.stderr[-4000:]}")
    return Run(run.stdout.strip(), *read_blobs(out))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Run | Exception]:
    """Every level this session tests (and the baseline) built and run, two at a time; the
    check program is built once per architecture, at its baseline instruction set (its
    code does not depend on the level)."""
    root = tmp_path_factory.mktemp("kernel_levels")
    wanted = session_levels(request)
    levels = [lv for lv in LEVELS if lv in wanted or lv == BASELINE]
    arches = {arch: flag for arch, flag in (("x86_64", "-march=x86-64"),
                                            ("aarch64", "-march=armv8-a"))
              if any(lv.arch == arch for lv in levels)}

    objects: dict[str, Path | Exception] = {}
    lock = threading.Lock()

    def check_object(arch: str) -> Path:
        """The check program's object for `arch`, built on first need (a run whose every
        level comes from the cache builds none)."""
        with lock:
            if arch not in objects:
                target = root / f"kernel_check-{arch}.o"
                try:
                    compile_cxx(f"kernel_check.cpp ({arch})", arch,
                                [arches[arch], "-c", str(CHECK_SOURCE), "-o", str(target)])
                    objects[arch] = target
                except (Unavailable, Broken) as failure:
                    objects[arch] = failure
        if isinstance(objects[arch], Exception):
            raise objects[arch]
        return objects[arch]

    def attempt(level: Level) -> Run | Exception:
        try:
            check_cpu(level)
            return build_and_run(level, lambda: check_object(level.arch), root / level.id)
        except (Unavailable, Broken) as failure:
            return failure

    with ThreadPoolExecutor(max_workers=2) as pool:
        return {lv.id: result for lv, result in zip(levels, pool.map(attempt, levels), strict=True)}


def session_levels(request) -> set[Level]:
    """The levels of this module's tests that the session runs (after -m and -k)."""
    levels = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None and "level" in callspec.params:
            levels.add(callspec.params["level"])
    return levels


def run_of(runs: dict[str, Run | Exception], level: Level) -> Run:
    result = runs[level.id]
    if isinstance(result, Broken):
        pytest.fail(str(result))
    if isinstance(result, Unavailable):
        message = f"{level.id}: {result}"
        (pytest.fail if result.tool_missing and os.environ.get("CI") else pytest.skip)(message)
    return result


# the slow tier's: x86-64 without FMA (two roundings, compared within bounds) and the two
# aarch64 levels below neon+dotprod (each a qemu run); the default tier checks the baseline,
# every x86-64 level this CPU has, and neon+dotprod
SLOW_LEVELS = {"x86_64-generic", "aarch64-neon", "aarch64-generic"}


@pytest.fixture(params=[pytest.param(lv, marks=pytest.mark.slow) if lv.id in SLOW_LEVELS
                        else lv for lv in LEVELS], ids=[lv.id for lv in LEVELS])
def level(request) -> Level:
    return request.param


# ---- the tests ---------------------------------------------------------------------------------

def test_level_is_the_one_built(runs, level):
    """The flags picked the level meant (not a fallback to generic)."""
    assert run_of(runs, level).level_reported == level.name


def test_level_matches_generic_bits(runs, level):
    if level == BASELINE:
        pytest.skip("the baseline itself")
    base, run = run_of(runs, BASELINE), run_of(runs, level)
    assert run.raw.keys() == base.raw.keys()
    different, near = [], {}
    for name, expected in base.raw.items():
        if run.raw[name] == expected:
            continue
        reason = tolerated(level, name)
        if reason is None:
            different.append(name)
            continue
        a, b = run.blobs[name].astype(np.float64), base.blobs[name].astype(np.float64)
        near[name] = (np.abs(a - b).max() / np.abs(b).max(), reason)
    print(f"\n{level.id}: {len(base.raw) - len(different) - len(near)} of {len(base.raw)} "
          f"blobs bit-identical to {BASELINE.id}")
    for reason in sorted({r for _, r in near.values()}):
        worst = max(diff for diff, r in near.values() if r == reason)
        print(f"  {sum(r == reason for _, r in near.values())} within {worst:.1e} of their "
              f"largest value: {reason}")
    assert not different, f"not bit-identical to generic: {different}"
    assert all(diff <= 1e-5 for diff, _ in near.values()), near


def test_level_matches_references(runs, level):
    blobs = run_of(runs, level).blobs
    figures = [check(blobs) for check in REFERENCE_CHECKS]
    print(f"\n{level.id}: " + "; ".join(figures))


# ---- numpy references --------------------------------------------------------------------------

def cases(blobs: dict[str, np.ndarray], pattern: str) -> list[str]:
    """The case prefixes whose names match `pattern` + an array name (at least one)."""
    found = sorted({m.group(1) for name in blobs if (m := re.fullmatch(pattern, name))})
    assert found, f"no blobs match {pattern}"
    return found


def within(actual: np.ndarray, expected: np.ndarray, bound: np.ndarray) -> float:
    """Asserts |actual - expected| <= bound elementwise; returns the worst fraction of it."""
    error = np.abs(actual.astype(np.float64) - expected)
    worst = float((error / bound).max())
    assert worst <= 1, f"max error {error.max():.3g}, {worst:.3g}x the bound"
    return worst


def check_rms_norm(blobs) -> str:
    worst = 0.0
    for p in cases(blobs, r"(rms_norm\.C\d+)\.out"):
        x, w, eps = (blobs[f"{p}.{a}"].astype(np.float64) for a in ("x", "w", "eps"))
        ref = w * x / np.sqrt((x * x).mean(1, keepdims=True) + eps[0])
        worst = max(worst, within(blobs[f"{p}.out"], ref, 1e-5 * np.abs(ref) + 1e-7))
    return f"rms_norm {worst:.2f} of 1e-5 rel"


def check_rotary(blobs) -> str:
    """The rotate-half formula in float32, the same products and sums: exact."""
    for p in cases(blobs, r"(rotary\.D\d+)\.out"):
        qkv, cos, sin = blobs[f"{p}.qkv"], blobs[f"{p}.cos"], blobs[f"{p}.sin"]
        pos, heads = blobs[f"{p}.positions"], int(blobs[f"{p}.num_heads"][0])
        D = cos.shape[1]
        half = D // 2
        x = qkv[:, : heads * D].reshape(len(pos), heads, D)  # (T, heads, D)
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        rotated = np.concatenate([x1 * c[..., :half] + (-x2) * s[..., :half],
                                  x2 * c[..., half:] + x1 * s[..., half:]], axis=-1)
        expected = qkv.copy()
        expected[:, : heads * D] = rotated.reshape(len(pos), heads * D)
        np.testing.assert_array_equal(blobs[f"{p}.out"], expected)
    return "rotary exact"


def check_silu(blobs) -> str:
    worst = worst_gelu = 0.0
    for p in cases(blobs, r"(silu\.I\d+)\.out"):
        gate_up = blobs[f"{p}.gate_up"].astype(np.float64)
        gate, up = np.split(gate_up, 2, axis=1)
        with np.errstate(over="ignore"):
            ref = gate / (1 + np.exp(-gate)) * up
        worst = max(worst, within(blobs[f"{p}.out"], ref, 1e-6 * np.abs(ref) + 1e-30))
        # tanh-GELU (torch's approximate="tanh"): 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g +
        # 0.044715 g^3), as g / (1 + exp(-2 y)), the same value (1 + tanh(y) cancels to 0 in
        # float64 below g = -7, where the value is still 1e-16)
        y = np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)
        with np.errstate(over="ignore"):
            gelu = gate / (1 + np.exp(-2 * y)) * up
        out = blobs[p.replace("silu.", "gelu.") + ".out"]
        # exp passes on its argument's float32 rounding (4 ulps of |2y|) as relative error
        bound = (1e-6 + 2.4e-7 * np.abs(2 * y)) * np.abs(gelu) + 1e-30
        worst_gelu = max(worst_gelu, within(out, gelu, bound))
    return (f"silu {worst:.2f} of 1e-6 rel, tanh-GELU {worst_gelu:.2f} of 1e-6 rel + 4 ulps "
            "of its exponent")


def check_int8_linear(blobs) -> str:
    """Exactly the kernel's W8A8 arithmetic in numpy; and near the unquantized product."""
    w, wscale, bias = (blobs[f"int8_linear.{a}"] for a in ("w", "wscale", "bias"))
    worst = 0.0
    for p in cases(blobs, r"(int8_linear\.M\d+)\.y"):
        x, y = blobs[f"{p}.x"], blobs[f"{p}.y"]
        b = bias if blobs[f"{p}.with_bias"][0] else np.zeros_like(bias)
        # x ~ (hi + lo / 254) * scale, hi and lo rounded to nearest even, lo clamped to 127
        scale = np.maximum(np.abs(x).max(1), np.float32(1e-8)) / np.float32(127)
        t = x / scale[:, None]
        hi = np.rint(t)
        lo = np.clip(np.rint((t - hi) * np.float32(254)), -127, 127)
        acc_hi = (hi.astype(np.int64) @ w.T.astype(np.int64)).astype(np.float32)
        acc_lo = (lo.astype(np.int64) @ w.T.astype(np.int64)).astype(np.float32)
        exact = ((acc_hi + acc_lo * (np.float32(1) / np.float32(254))) * scale[:, None]) * wscale
        np.testing.assert_array_equal(y, exact + b)
        # each activation within scale / 508 of its two parts
        ref = x.astype(np.float64) @ (w * wscale.astype(np.float64)[:, None]).T + b
        bound = (scale[:, None] / 508) * (np.abs(w) @ np.ones(w.shape[1]) * wscale)[None, :]
        worst = max(worst, within(y, ref, 1.01 * bound + 1e-6))
    return f"int8 exact, {worst:.2f} of the quantization bound"


def check_q4_linear(blobs) -> str:
    """Near the dequantized product: each activation within (amax / 127) / 508 of its group
    with 15-bit activations, (amax / 127) / 2 with 8-bit ones."""
    codes, bias = blobs["q4_linear.codes"].astype(np.float64), blobs["q4_linear.bias"]
    d, m = (blobs[f"q4_linear.{a}"].view(np.float16).astype(np.float64) for a in ("d", "m"))
    N, K = codes.shape
    w = codes * np.repeat(d, 32, axis=1) + np.repeat(m, 32, axis=1)  # (N, K)
    worst = {}
    for kind, half_step in (("q4_linear", 508), ("q4_linear_a8", 2)):
        worst[kind] = 0.0
        for p in cases(blobs, rf"({kind}\.M\d+)\.y"):
            x, y = blobs[f"{p}.x"].astype(np.float64), blobs[f"{p}.y"]
            b = bias if blobs[f"{p}.with_bias"][0] else np.zeros_like(bias)
            ref = x @ w.T + b
            step = np.abs(x).reshape(len(x), K // 32, 32).max(2) / 127 / half_step  # (M, G)
            quantization = step @ np.abs(w).reshape(N, K // 32, 32).sum(2).T
            rounding = 1e-5 * (np.abs(x) @ np.abs(w).T + np.abs(b))
            worst[kind] = max(worst[kind], within(y, ref, 1.01 * quantization + rounding))
    return (f"q4 {worst['q4_linear']:.2f} (8-bit activations: {worst['q4_linear_a8']:.2f}) "
            "of the quantization bound")


def check_kquant(blobs) -> str:
    """Rows dequantized as gguf-py dequantizes the file's blocks, bit for bit; the GEMM near
    the product of those rows with the activations as quantized per 256 (int8, one scale
    s = amax / 127: llama.cpp's Q8_K): integer sums exact, float rounding within 1e-5. For
    the K-quant mix, the legacy types and Q8_0 alone."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from tests.quantization.test_kquant import term_magnitudes

    worst = 0.0
    for weight in ("kquant", "legacy", "q8", "q3", "iq4"):
        parts, terms = [], []
        for key in sorted(k for k in blobs if k.startswith(f"{weight}.part")
                          and k.endswith(".blocks")):
            part = key.removesuffix(".blocks")
            qtype = QT[part.split(".part", 1)[1].split("_", 1)[1].upper()]  # .part0_q4_k
            raw = blobs[key]
            w = gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)
            np.testing.assert_array_equal(blobs[f"{part}.rows"], w[::-1])
            parts.append(w)
            terms.append(term_magnitudes(raw, qtype))
        assert parts, weight
        w = np.concatenate(parts).astype(np.float64)
        terms = np.concatenate(terms)
        for p in cases(blobs, rf"({weight}_linear\.M\d+)\.y"):
            x, y = blobs[f"{p}.x"], blobs[f"{p}.y"]
            b = (blobs[f"{weight}.bias"] if blobs[f"{p}.with_bias"][0]
                 else np.zeros(len(w), np.float32))
            groups = x.reshape(len(x), -1, 256)
            amax = np.abs(groups).max(2, keepdims=True)
            inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
            inv = inv.astype(np.float32)
            q = np.round(groups * inv)
            xq = (q * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)
            ref = xq @ w.T + b
            bound = 1e-5 * (np.abs(xq) @ terms.T + np.abs(b)) + 1e-6
            worst = max(worst, within(y, ref, bound))
    return f"kquant and legacy rows exact, GEMM {worst:.2f} of 1e-5 rel"


def check_f32_linear(blobs) -> str:
    w, bias = blobs["f32_linear.w"].astype(np.float64), blobs["f32_linear.bias"]
    worst = 0.0
    for p in cases(blobs, r"(f32_linear(?:_from)?\.M\d+)\.y"):
        x = blobs[f"{p}.x"].astype(np.float64)
        start = blobs.get(f"{p}.init", np.zeros((len(x), len(w)), np.float32)).astype(np.float64)
        with_bias = f"{p}.with_bias" in blobs and blobs[f"{p}.with_bias"][0]
        b = bias if with_bias else np.zeros_like(bias)
        ref = start + x @ w.T + b
        bound = 1e-5 * (np.abs(start) + np.abs(x) @ np.abs(w).T + np.abs(b))
        worst = max(worst, within(blobs[f"{p}.y"], ref, bound))
    return f"f32 linear {worst:.2f} of 1e-5 rel"


def check_quantize_q4(blobs) -> str:
    """int4.py's quantize_groups in numpy's float32 arithmetic: the same bits."""
    w = blobs["quantize_q4.w"]
    groups = w.reshape(w.shape[0], -1, 32)
    lo, hi = groups.min(-1), groups.max(-1)
    d = ((hi - lo) / np.float32(15)).astype(np.float16)
    m = lo.astype(np.float16)
    step = d.astype(np.float32)
    inverse = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), 0).astype(np.float32)
    t = (groups - m.astype(np.float32)[..., None]) * inverse[..., None]
    codes = np.clip(np.rint(t), 0, 15).astype(np.uint8).reshape(w.shape)
    np.testing.assert_array_equal(blobs["quantize_q4.codes"], codes)
    np.testing.assert_array_equal(blobs["quantize_q4.d"], d.view(np.uint16))
    np.testing.assert_array_equal(blobs["quantize_q4.m"], m.view(np.uint16))
    return "q4 quantization exact"


def check_argmax(blobs) -> str:
    for p in cases(blobs, r"(argmax\.N\d+)\.out"):
        x = blobs[f"{p}.x"]
        expected = np.where(np.isnan(x).any(1), -1, np.argmax(np.nan_to_num(x, nan=0), 1))
        np.testing.assert_array_equal(blobs[f"{p}.out"], expected)
    # NaN in the vector part, NaN in the tail, ties (first wins), the tail, -inf, -0 / +0
    assert list(blobs["argmax.N100.out"][1:]) == [-1, -1, 20, 50, 97, 0, 30]
    assert list(blobs["argmax.N10.out"]) == [2, 6]
    return "argmax exact"


def check_bitmask(blobs) -> str:
    x, words, rows = blobs["bitmask.x"], blobs["bitmask.words"], blobs["bitmask.rows"]
    N = x.shape[1]
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :N]
    expected = x.copy()
    for r, row in enumerate(rows):
        expected[row, bits[r] == 0] = -np.inf
    np.testing.assert_array_equal(blobs["bitmask.out"], expected)
    return "bitmask exact"


def dequantized_cache(blobs, p: str, which: str) -> np.ndarray:
    """(blocks * block_size, Hkv, D) float64 of a written cache, as the kernel reads it."""
    cache = blobs[f"{p}.{which}_cache"]
    cache = cache.reshape(-1, *cache.shape[2:])
    if cache.dtype == np.uint16:  # bf16 bits: a float's upper half
        return (cache.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if cache.dtype == np.int8:
        scales = blobs[f"{p}.{which}_scales"].reshape(-1, cache.shape[1], 1)
        return (cache.astype(np.float32) * scales).astype(np.float64)
    return cache.astype(np.float64)


def check_kv_write(blobs, p: str) -> None:
    """fp32 copied, bf16 rounded as torch rounds, int8 by a scale of amax / 127 per row."""
    slots = blobs[f"{p}.slot_mapping"]
    for which in ("k", "v"):
        cache = blobs[f"{p}.{which}_cache"]
        Hkv, D = cache.shape[2:]
        rows = blobs[f"{p}.{which}"][:, : Hkv * D].reshape(-1, Hkv, D)  # (T, Hkv, D)
        written = cache.reshape(-1, Hkv, D)[slots]
        if cache.dtype == np.float32:
            np.testing.assert_array_equal(written, rows)
        elif cache.dtype == np.uint16:
            bf16 = torch.from_numpy(rows.copy()).to(torch.bfloat16).view(torch.int16).numpy()
            np.testing.assert_array_equal(written, bf16.view(np.uint16))
        else:
            scale = np.maximum(np.abs(rows).max(2), np.float32(1e-8)) / np.float32(127)
            np.testing.assert_array_equal(blobs[f"{p}.{which}_scales"].reshape(-1, Hkv)[slots],
                                          scale)
            expected = np.rint(np.clip(rows / scale[..., None], -127, 127)).astype(np.int8)
            np.testing.assert_array_equal(written, expected)


def dense_attention(blobs, p: str, scale: float, window: int, softcap: float) -> np.ndarray:
    """(Tq, H, D): a softmax over each query's keys gathered through its block table."""
    keys, values = dequantized_cache(blobs, p, "k"), dequantized_cache(blobs, p, "v")
    tables, starts = blobs[f"{p}.block_tables"], blobs[f"{p}.query_start"]
    contexts, block_size = blobs[f"{p}.context_lens"], blobs[f"{p}.k_cache"].shape[1]
    Hkv, D = keys.shape[1:]
    q = blobs[f"{p}.q"].astype(np.float64)
    H = q.shape[1] // D
    kv_head = np.arange(H) // (H // Hkv)
    out = np.zeros((starts[-1], H, D))
    for b in range(len(contexts)):
        for i in range(starts[b + 1] - starts[b]):
            pos, token = contexts[b] + i, starts[b] + i
            first = max(0, pos + 1 - window) if window > 0 else 0
            t = np.arange(first, pos + 1)
            slots = tables[b, t // block_size] * block_size + t % block_size
            k, v = keys[slots][:, kv_head], values[slots][:, kv_head]  # (n, H, D)
            scores = scale * np.einsum("nhd,hd->hn", k, q[token, : H * D].reshape(H, D))
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            probs = np.exp(scores - scores.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
            out[token] = np.einsum("hn,nhd->hd", probs, v)
    return out


def check_attention(blobs) -> str:
    worst = 0.0
    for p in cases(blobs, r"(attention\.\w+\.D\d+)\.q"):
        check_kv_write(blobs, p)
        for variant in ("plain", "window", "softcap"):
            scale, window, softcap = blobs[f"{p}.{variant}.params"]
            ref = dense_attention(blobs, p, float(scale), int(window), float(softcap))
            worst = max(worst, within(blobs[f"{p}.{variant}.out"], ref, 1e-5 * np.abs(ref) + 1e-6))
    return f"kv writes exact, attention {worst:.2f} of 1e-5 rel + 1e-6"


REFERENCE_CHECKS = (check_rms_norm, check_rotary, check_silu, check_int8_linear,
                    check_q4_linear, check_f32_linear, check_quantize_q4, check_argmax,
                    check_bitmask,
                    check_attention, check_kquant)
