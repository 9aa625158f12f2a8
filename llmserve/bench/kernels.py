"""`llmserve bench kernels`: every linear-layer kernel this machine could run a model's
weights on, timed on that model's own shapes at batch 1 (decode) and at a serving batch.

Candidates: llmserve's native int4 (15- and 8-bit activations), int8 and float32 GEMMs at
the instruction-set level in use (LLMSERVE_CPU_ISA), torch's `F.linear` in float32 and
bfloat16, its weight-only int8 and int4 kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, which vectorise only for some activation dtypes) and oneDNN's
`_int_mm` where the CPU has int8 dot products (VNNI or AMX: elsewhere it is a reference
loop). A time is one model step's linears (every layer's qkv, o, gate_up and down, and the
LM head), the best of a few repeats. The table says which candidate the engine runs by
default and for `--dtype float32`; a default slower than float32 at a batch size is flagged
(the default path must never be). Then the attention backends, prefill and decode, for the
default path's bfloat16 cache and the exact path's float32 one, and which one "auto" runs
(`attention_choice.choose_attention`).

The default is the engine's decision (`kernel_choice.choose_quantization`: cached, or timed
now), printed with its timings; `retime` decides again now, the linears' format and the
attention backends alike, and replaces the cached decisions unless the machine is busy.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.bench.latency import measure_int8_peak
from llmserve.config.model import ModelConfig
from llmserve.kernels import cpu_flags, level_of, native
from llmserve.loader.attention_choice import (
    ATTENTION_DECODE,
    ATTENTION_PREFILL,
    choose_attention,
    pick_attention,
    time_attention,
)
from llmserve.loader.kernel_choice import BATCHES, choose_quantization, linear_shapes
from llmserve.loader.quiet_timing import best_seconds


@dataclass
class Candidate:
    name: str
    run_as: str  # what the engine calls this candidate ("int4", "float32", "" if never)
    make: Callable[[torch.Tensor], Callable[[torch.Tensor], Any]]  # weight -> x -> y
    # bytes a (out, in) weight occupies in this format (what a decode streams); None: not
    # reported
    weight_bytes: Callable[[int, int], int] | None = None
    integer: bool = False  # int8 dot products: reported against the level's peak


READ_BYTES = 1 << 30  # the read-bandwidth probe: a sum over 1 GiB (far past any cache)


def measure_read_bandwidth() -> float:
    """Bytes per second that a pass summing 1 GiB of floats reads (the compute threads),
    the best of 3: what a decode streaming its weights once can reach."""
    data = torch.ones(READ_BYTES // 4)
    data.sum()
    return READ_BYTES / best_seconds(lambda: data.sum(), 0.0, max_calls=1, repeats=3)


def candidates(main_block_type: str = "Q4_K") -> list[Candidate]:
    from llmserve.quantization.int4 import PackedInt4Weight, int4_linear, packed_int4_bytes
    from llmserve.quantization.int8 import PackedInt8Weight, int8_linear, packed_int8_bytes
    from llmserve.quantization.packed_float import (
        PackedFloatWeight,
        float_linear,
        packed_float_bytes,
    )

    out = []
    if native() is not None:
        def native_int4(w):
            packed = PackedInt4Weight(w)
            return lambda x: int4_linear(x, packed)

        def native_int4_a8(w):
            packed = PackedInt4Weight(w, activation_bits=8)
            return lambda x: int4_linear(x, packed)

        def native_int8(w):
            packed = PackedInt8Weight(w)
            return lambda x: int8_linear(x, packed)

        def native_f32(w):
            packed = PackedFloatWeight(w)
            return lambda x: float_linear(x, packed)

        out += [*kquant_candidates(main_block_type),
                Candidate("llmserve int4 (W4A15)", "int4", native_int4, packed_int4_bytes, True),
                Candidate("llmserve int4-a8 (W4A8)", "int4-a8", native_int4_a8,
                          packed_int4_bytes, True),
                Candidate("llmserve int8 (W8A15)", "int8", native_int8, packed_int8_bytes, True),
                Candidate("llmserve float32", "float32", native_f32, packed_float_bytes)]
    out += [Candidate("torch F.linear float32", "" if native() else "float32",
                      lambda w: lambda x: F.linear(x, w)),
            Candidate("torch F.linear bfloat16", "", _torch_bf16),
            Candidate("torch _weight_int8pack_mm", "", _torch_int8pack),
            Candidate("torch _weight_int4pack_mm_for_cpu", "", _torch_int4pack)]
    if {"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_flags()):
        out.append(Candidate("torch _int_mm (oneDNN)", "", _torch_int_mm))
    return out


def kquant_candidates(main: str = "Q4_K") -> list[Candidate]:
    """The kernel on a file's own blocks, on random blocks of each type it runs (what the
    engine calls "kquant" for a file whose bytes are mostly `main`; its other types run on
    the same kernel)."""
    import numpy as np

    from llmserve.quantization.kquant import (
        KQUANT_TYPES,
        PackedKQuantWeight,
        kquant_linear,
        packed_kquant_bytes,
        random_blocks,
    )

    def make(qtype):
        def build(w):
            n, k = w.shape
            if k % 256:
                raise RuntimeError(f"{k} columns: not whole 256-value blocks")
            packed = PackedKQuantWeight([random_blocks(qtype, n, k, np.random.default_rng(0))])
            return lambda x: kquant_linear(x, packed)
        return build

    def size(qtype):
        return lambda n, k: packed_kquant_bytes([(qtype, n)], k) or 0

    return [Candidate(f"llmserve kquant {t.name}", "kquant" if t.name == main else "", make(t),
                      size(t), True) for t in KQUANT_TYPES]


def _torch_bf16(w: torch.Tensor):
    wb = w.bfloat16()
    return lambda x: F.linear(x.bfloat16(), wb)


def _torch_int8pack(w: torch.Tensor):
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).to(torch.int8)
    return lambda x: torch._weight_int8pack_mm(x.bfloat16(), q, scale.bfloat16())


def _torch_int4pack(w: torch.Tensor):
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k), 2)
    # (K / 32, N, 2): scale and zero point (the value of code 8) per group
    scales_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32,
                                                        scales_zeros.bfloat16())


def _torch_int_mm(w: torch.Tensor):
    q = torch.round(w / (w.abs().amax(dim=1, keepdim=True) / 127)).to(torch.int8).t()

    def run(x):
        rows = x if x.shape[0] > 16 else F.pad(x, (0, 0, 0, 17 - x.shape[0]))
        return torch._int_mm(torch.round(rows.clamp(-1, 1) * 127).to(torch.int8), q)
    return run


def time_step(candidate: Candidate, shapes, batch: int) -> float | str:
    """Milliseconds for one step's linears at `batch` rows, or why it cannot run."""
    total = 0.0
    generator = torch.Generator().manual_seed(0)
    for n, k, count in shapes:
        w = torch.randn(n, k, generator=generator) * 0.05
        x = torch.randn(batch, k, generator=generator)
        try:
            fn = candidate.make(w)
            fn(x)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            return f"n/a: {str(exc).splitlines()[0][:60]}"
        total += best_seconds(lambda fn=fn, x=x: fn(x), 0.1, max_calls=50) * count
    return total * 1e3


def run_kernels(config: ModelConfig, batches: tuple[int, ...], stored: str | None = "int4",
                block_type: str = "Q4_K", retime: bool = False) -> dict[str, Any]:
    """Every candidate timed on `config`'s shapes at each batch; `stored`: the format the
    model's file keeps ("int4", "kquant", "int8"; as `gguf_stored_quantization`; for
    "kquant", `block_type` the GGUF type of most of its blocks), for which one the engine
    runs by default; `retime`: the engine's decisions made again now (module docstring)."""
    from llmserve.bench.machine import machine_info

    lib = native()
    # the decision first: the table's timings below take a while, a cached decision none
    choice = choose_quantization(stored, config, block_type, retime) if lib else None
    shapes = linear_shapes(config)
    bandwidth, peak = measure_read_bandwidth(), measure_int8_peak()
    rows = []
    for candidate in candidates(block_type):
        times = {b: time_step(candidate, shapes, b) for b in batches}
        step_bytes = None
        if candidate.weight_bytes is not None:
            step_bytes = sum(candidate.weight_bytes(n, k) * count for n, k, count in shapes)
        rows.append({"kernel": candidate.name, "run_as": candidate.run_as, "ms": times,
                     "bytes": step_bytes, "integer": candidate.integer})
    default = "float32" if lib is None else (stored if choice is None
                                             else choice.quantization) or "float32"
    attention = None
    if lib is not None:  # the default path's bfloat16 cache, and the exact path's float32
        attention = {str(dtype).removeprefix("torch."): _attention_entry(config, dtype, retime)
                     for dtype in (torch.bfloat16, torch.float32)}
    decision = None if choice is None else {
        "quantization": choice.quantization, "source": choice.source, "why": choice.why,
        "ms": choice.ms, "describe": choice.describe()}
    return {"machine": machine_info(), "level": level_of(lib) if lib else None,
            "amx": bool(lib and lib.set_amx(-1)), "batches": list(batches), "shapes": shapes,
            "rows": rows,
            "read_bandwidth_bytes_per_s": bandwidth, "int8_peak_ops_per_s": peak,
            "default": default, "decision": decision, "attention": attention}


def _attention_entry(config: ModelConfig, dtype: torch.dtype, retime: bool) -> dict[str, Any]:
    """The backends' ms and which one the engine runs: timed now and the rule applied, or
    (`retime`) decided again now, as a start would."""
    if retime:
        choice = choose_attention(config, dtype, retime=True)
        return {"ms": choice.ms, "engine": choice.backend, "source": choice.source,
                "describe": choice.describe()}
    timing = time_attention(config, dtype)
    return {"ms": timing.best(), "engine": pick_attention(timing)}


def decided_while_busy(result: dict[str, Any]) -> bool:
    """Whether a decision in `result` was left to the default because the machine was busy
    (under `retime`: the cached decisions were left as they were)."""
    decisions = [result["decision"], *(result["attention"] or {}).values()]
    return any(d is not None and d.get("source") == "busy" for d in decisions)


def decision_lines(result: dict[str, Any]) -> list[str]:
    """The engine's decision for the linears (and, where retimed, the attention backends):
    its source, each candidate's best ms a step against the checkpoint's default format, and
    the rule's reason."""
    decision = result.get("decision")
    if decision is None:
        return []
    ms = decision["ms"]
    own = next(iter(ms))  # the checkpoint's default format, timed first
    lines = [f"decision: {decision['describe']}",
             f"  {'candidate':12s}" + "".join(f"{'batch ' + str(b):>12s}" for b in BATCHES)
             + "".join(f"{'vs ' + own + ' at ' + str(b):>18s}" for b in BATCHES)]
    for name, times in ms.items():
        lines.append(f"  {name:12s}" + "".join(f"{times[b]:12.2f}" for b in BATCHES)
                     + "".join(f"{ms[own][b] / times[b]:17.2f}x" for b in BATCHES))
    for kv, entry in (result.get("attention") or {}).items():
        if "describe" in entry:
            lines.append(f"decision ({kv} KV cache): {entry['describe']}")
    return lines


def roofline_lines(result: dict[str, Any]) -> list[str]:
    """Each kernel against the machine: at batch 1 the bytes its step streams a second
    against the read bandwidth (MBU); at the largest batch its integer operations a second
    against the level's int8 dot-product peak (2 M N K per step; float kernels: none)."""
    bandwidth, peak = result["read_bandwidth_bytes_per_s"], result["int8_peak_ops_per_s"]
    big = max(result["batches"])
    ops = 2 * big * sum(n * k * count for n, k, count in result["shapes"])
    lines = ["(each shape's weight is re-read: where it fits the caches, GB/s and MBU at batch "
             "1 are above what a decode streaming every layer's weights reaches)",
             f"read bandwidth {bandwidth / 1e9:.1f} GB/s (a sum over 1 GiB, "
             f"{result['machine']['num_threads']} threads); int8 dot-product peak "
             + (f"{peak / 1e9:.0f} G int ops/s (level {result['level']})" if peak else "n/a")
             + ("; AMX tiles on: the K-quant GEMMs of 32+ rows run there, past that peak"
                if result.get("amx") else ""),
             f"{'kernel':38s}{'MB a step':>12s}{'GB/s at 1':>12s}{'MBU':>8s}"
             f"{'Gop/s at ' + str(big):>16s}{'of peak':>9s}"]
    for row in result["rows"]:
        if row["bytes"] is None:
            continue
        one, many = row["ms"].get(1), row["ms"].get(big)
        cells = f"{row['kernel']:38s}{row['bytes'] / 1e6:12.1f}"
        if isinstance(one, float):
            rate = row["bytes"] / (one / 1e3)
            cells += f"{rate / 1e9:12.1f}{100 * rate / bandwidth:7.0f}%"
        else:
            cells += f"{'':12s}{'':8s}"
        if row["integer"] and peak and isinstance(many, float):
            rate = ops / (many / 1e3)
            cells += f"{rate / 1e9:16.0f}{100 * rate / peak:8.0f}%"
        lines.append(cells)
    return lines


def format_kernels(result: dict[str, Any]) -> str:
    from llmserve.bench.machine import format_machine

    batches = result["batches"]
    lines = [format_machine(result["machine"]),
             f"kernel level: {result['level'] or 'none (no native kernels)'}; one step's "
             f"linears (ms, best of 3); engine: default = {result['default']}, "
             "--dtype float32 = float32",
             f"{'kernel':38s}" + "".join(f"{'batch ' + str(b):>14s}" for b in batches)
             + "  engine runs it as"]
    fastest = {b: min((r["ms"][b] for r in result["rows"] if isinstance(r["ms"][b], float)),
                      default=None) for b in batches}
    for row in result["rows"]:
        cells = []
        for b in batches:
            ms = row["ms"][b]
            mark = "*" if ms == fastest[b] else " "
            cells.append(f"{ms:13.2f}{mark}" if isinstance(ms, float) else f"{ms[:13]:>14s}")
        role = {"": "", result["default"]: "default"}.get(row["run_as"], "")
        role = ", ".join(x for x in (role, "--dtype float32" if row["run_as"] == "float32"
                                     else "") if x) or (row["run_as"] and f"--quantization "
                                                        f"{row['run_as']}")
        lines.append(f"{row['kernel']:38s}" + "".join(cells) + f"  {role}")
    by_role = {r["run_as"]: r["ms"] for r in result["rows"] if r["run_as"]}
    for b in batches:
        d, f = by_role.get(result["default"], {}).get(b), by_role.get("float32", {}).get(b)
        if isinstance(d, float) and isinstance(f, float):
            verdict = "ok" if d <= f else "SLOWER than float32"
            lines.append(f"batch {b}: default {d:.2f} ms vs float32 {f:.2f} ms "
                         f"({f / d:.2f}x): {verdict}")
    lines.append("* the fastest at that batch size")
    lines += decision_lines(result)
    if result.get("read_bandwidth_bytes_per_s"):
        lines += roofline_lines(result)
    if result.get("attention"):
        lines.append(f"attention, ms over the layers: prefill of {ATTENTION_PREFILL[0]} "
                     f"prompts x {ATTENTION_PREFILL[1]} tokens, decode of {ATTENTION_DECODE[0]} "
                     f"sequences at context {ATTENTION_DECODE[1]}")
        lines.append(f"{'backend':38s}{'KV cache':>14s}{'prefill':>14s}{'decode':>14s}"
                     "  engine runs")
        for kv, entry in result["attention"].items():
            for name, ms in entry["ms"].items():
                chosen = "yes (auto)" if name == entry["engine"] else ""
                lines.append(f"{name:38s}{kv:>14s}{ms['prefill']:14.2f}{ms['decode']:14.2f}"
                             f"  {chosen}")
    return "\n".join(lines)
