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
(`kernel_choice.choose_attention`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmserve.config.model import ModelConfig
from llmserve.kernels import cpu_flags, level_of, native
from llmserve.loader.kernel_choice import (
    ATTENTION_DECODE,
    ATTENTION_PREFILL,
    best_seconds,
    linear_shapes,
    pick_attention,
    time_attention,
)


@dataclass
class Candidate:
    name: str
    run_as: str  # what the engine calls this candidate ("int4", "float32", "" if never)
    make: Callable[[torch.Tensor], Callable[[torch.Tensor], Any]]  # weight -> x -> y


def candidates() -> list[Candidate]:
    from llmserve.quantization.int4 import PackedInt4Weight, int4_linear
    from llmserve.quantization.int8 import PackedInt8Weight, int8_linear
    from llmserve.quantization.packed_float import PackedFloatWeight, float_linear

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

        out += [Candidate("llmserve int4 (W4A15)", "int4", native_int4),
                Candidate("llmserve int4-a8 (W4A8)", "int4-a8", native_int4_a8),
                Candidate("llmserve int8 (W8A15)", "int8", native_int8),
                Candidate("llmserve float32", "float32", native_f32)]
    out += [Candidate("torch F.linear float32", "" if native() else "float32",
                      lambda w: lambda x: F.linear(x, w)),
            Candidate("torch F.linear bfloat16", "", _torch_bf16),
            Candidate("torch _weight_int8pack_mm", "", _torch_int8pack),
            Candidate("torch _weight_int4pack_mm_for_cpu", "", _torch_int4pack)]
    if {"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_flags()):
        out.append(Candidate("torch _int_mm (oneDNN)", "", _torch_int_mm))
    return out


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


def run_kernels(config: ModelConfig, batches: tuple[int, ...]) -> dict[str, Any]:
    from llmserve.bench.machine import machine_info
    from llmserve.loader.model_loader import auto_quantization

    shapes = linear_shapes(config)
    rows = []
    for candidate in candidates():
        times = {b: time_step(candidate, shapes, b) for b in batches}
        rows.append({"kernel": candidate.name, "run_as": candidate.run_as, "ms": times})
    default = auto_quantization("int4", torch.device("cpu"), config) or "float32"
    lib = native()
    attention = None
    if lib is not None:  # the default path's bfloat16 cache, and the exact path's float32
        attention = {str(dtype).removeprefix("torch."): {
            "ms": ms, "engine": pick_attention(ms)}
            for dtype in (torch.bfloat16, torch.float32)
            for ms in [time_attention(config, dtype)]}
    return {"machine": machine_info(), "level": level_of(lib) if lib else None,
            "batches": list(batches), "shapes": shapes, "rows": rows,
            "default": default, "attention": attention}


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
