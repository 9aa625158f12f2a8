"""`llmserve bench latency`: prefill time and decode TPOT per batch size, with MBU and MFU.

Memory bandwidth is measured as a large tensor copy (bytes read + bytes written per
second) right after each decode run, and compute once as a GEMM of the kind the path
computes in (`peak_kind`: fp32 for float32, bf16 for bfloat16, int8 `_int_mm` for the int8
path). Decode at small batch is bound by memory, so its yardstick is MBU, per decode run
against the bandwidth measured right after it, the median over the runs::

    MBU = (weight bytes + KV bytes read per step) / TPOT / copy bandwidth

(On a shared VM the bandwidth moves between phases within seconds: the build machine
copies at ~65-70 GB/s for the first seconds after an idle spell and ~40 GB/s sustained, so
a peak taken at another moment than the run measures the machine's mood, not the path.)

and prefill's (and large batches') is MFU = model FLOPs per second / peak FLOP/s. A ratio
above 1 means the peak was underestimated; it is reported as ">100%", never as a number.
"""

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmserve.bench.machine import (
    effective_quantization,
    format_machine,
    format_path,
    machine_info,
    path_info,
)
from llmserve.bench.throughput import synthetic_prompts
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

_COPY_BYTES = 512 * 2**20
_GEMM_SIZE = 2048  # M >= 32 as `_int_mm` wants, and big enough to reach the kernel's peak
_REPEATS = 5
_TIME_BUDGET_S = 3.0  # per measurement: a slow (emulated) GEMM stops repeating after this

GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               "int8": torch.int8}
DTYPE_PEAK_KIND = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The GEMM each quantization method's linear layers run; a method missing here is compared
# with the largest measured peak, so its MFU stays a lower bound. (The int8 and int4 paths
# multiply two int8 parts of every activation, by int8 or 4-bit codes, in int8 dot
# products: their MFU in model FLOPs tops out near 50%.)
QUANTIZATION_PEAK_KIND = {"int8": "int8", "int4": "int8", "int4-a8": "int8", "kquant": "int8"}


def peak_kind(quantization: str | None, dtype: torch.dtype) -> str | None:
    """The GEMM kind a path computes in, or None when it is not known (use the max peak)."""
    if quantization in (None, "none"):
        return DTYPE_PEAK_KIND.get(dtype)
    return QUANTIZATION_PEAK_KIND.get(quantization)


def llm_peak_kind(llm: LLM) -> str | None:
    """`peak_kind` of a loaded LLM: the quantization its linear layers run, and its dtype."""
    return peak_kind(effective_quantization(llm), llm.engine.dtype)


@dataclass(frozen=True)
class MachinePeaks:
    """Copy bandwidth and GEMM throughput per kind; `kind` picks the MFU yardstick."""

    bandwidth_bytes_per_s: float
    gemm_flops_per_s: dict[str, float] = field(default_factory=dict)
    kind: str | None = None  # None: the largest measured peak

    @property
    def flops_per_s(self) -> float:
        if self.kind is not None and self.kind in self.gemm_flops_per_s:
            return self.gemm_flops_per_s[self.kind]
        return max(self.gemm_flops_per_s.values())

    @property
    def flops_label(self) -> str:
        if self.kind is not None and self.kind in self.gemm_flops_per_s:
            return f"{self.kind} GEMM"
        best = max(self.gemm_flops_per_s, key=self.gemm_flops_per_s.__getitem__)
        return f"max of measured GEMMs ({best}; compute kind unknown)"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_kind": self.kind, "flops_per_s": self.flops_per_s}


def format_ratio(value: float) -> str:
    """A utilisation as a percentage, never above 100%: an excess means the peak is low."""
    return ">100%*" if value > 1.0 else f"{value:.1%}"


def capped(name: str, value: float) -> dict[str, Any]:
    """JSON fields of a utilisation: `name` at most 1.0, and whether it went past that."""
    return {name: min(value, 1.0), f"{name}_exceeds_peak": value > 1.0}


@dataclass(frozen=True)
class LatencyResult:
    batch: int
    input_len: int
    output_len: int
    prefill_s: float
    tpot_s: float
    bytes_per_step: float
    decode_flops_per_step: float
    prefill_flops: float
    # every decode run's TPOT when there were several (`tpot_s` is their median)
    tpot_runs_s: tuple[float, ...] = ()
    # the copy bandwidth measured right after each decode run, when it was
    bandwidth_runs: tuple[float, ...] = ()

    def mbu(self, peaks: MachinePeaks) -> float:
        """Against each run's own bandwidth (the median over runs) when measured, else
        against the peak."""
        if self.bandwidth_runs:
            tpots = self.tpot_runs_s or (self.tpot_s,)
            return statistics.median(self.bytes_per_step / t / bw
                                     for t, bw in zip(tpots, self.bandwidth_runs, strict=True))
        return self.bytes_per_step / self.tpot_s / peaks.bandwidth_bytes_per_s

    def decode_mfu(self, peaks: MachinePeaks) -> float:
        return self.decode_flops_per_step / self.tpot_s / peaks.flops_per_s

    def prefill_mfu(self, peaks: MachinePeaks) -> float:
        return self.prefill_flops / self.prefill_s / peaks.flops_per_s

    def to_dict(self, peaks: MachinePeaks) -> dict[str, Any]:
        return {**asdict(self), "decode_tokens_per_s": self.batch / self.tpot_s,
                **capped("mbu", self.mbu(peaks)), **capped("decode_mfu", self.decode_mfu(peaks)),
                **capped("prefill_mfu", self.prefill_mfu(peaks))}


def _best_time(fn: Callable[[], object], repeats: int = _REPEATS) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    budget_end = time.perf_counter() + _TIME_BUDGET_S
    for i in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if i >= 1 and time.perf_counter() > budget_end:
            break
    return best


def _sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_gemm(kind: str, device: torch.device | str = "cpu") -> float:
    """FLOP/s (ops/s for int8) of one square GEMM of `kind` on `device`."""
    device = torch.device(device)
    sync = _sync_fn(device)
    n = _GEMM_SIZE
    if kind == "int8":  # int8 x int8 -> int32, the product the int8 path computes
        # on the CPU, the level's own dot product where that is faster: without VNNI or AMX
        # `_int_mm` is a reference loop (no yardstick for the native int8 and int4 paths,
        # and 110 s at this size on a 2-core Zen 3), so a small probe decides first
        peak = measure_int8_peak() if device.type == "cpu" else None
        if peak is not None and _int_mm_rate(256, device) < peak / 2:
            return peak
        return max(_int_mm_rate(n, device), peak or 0.0)
    else:
        a = torch.randn(n, n, device=device).to(GEMM_DTYPES[kind])
        b = torch.randn(n, n, device=device).to(GEMM_DTYPES[kind])
        seconds = _best_time(lambda: (torch.mm(a, b), sync()))
        if kind == "fp32" and device.type == "cpu":  # the exact path's own GEMM, if faster
            seconds = min(seconds, _native_fp32_seconds(a, b))
    return 2 * n**3 / seconds


def _int_mm_rate(n: int, device: torch.device) -> float:
    """Integer operations per second of `torch._int_mm` on (n, n) int8 matrices."""
    sync = _sync_fn(device)
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    return 2 * n**3 / _best_time(lambda: (torch._int_mm(a, b), sync()))


def measure_int8_peak() -> float | None:
    """Integer operations per second of the level's int8 dot product (simd.h's dot4 on
    registers, every compute thread; kernels/peak.cpp); None without the native kernels."""
    import ctypes

    from llmserve.kernels import native

    lib = native()
    if lib is None:
        return None
    sink = ctypes.c_int32()
    iterations = 1 << 20
    lib.int8_dot_peak(iterations // 16, ctypes.byref(sink))  # warm the pool
    ops = lib.int8_dot_peak(iterations, ctypes.byref(sink))
    return ops / _best_time(lambda: lib.int8_dot_peak(iterations, ctypes.byref(sink)))


def _native_fp32_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one product on the native float32 GEMM (inf where it does not run)."""
    from llmserve.quantization.packed_float import PackedFloatWeight, can_pack_weights, float_linear

    if not can_pack_weights():
        return float("inf")
    weight = PackedFloatWeight(b.t().contiguous())
    return _best_time(lambda: float_linear(a, weight))


def measure_bandwidth(device: torch.device | str = "cpu") -> float:
    """Copy bandwidth, bytes read + bytes written per second."""
    device = torch.device(device)
    sync = _sync_fn(device)
    src = torch.ones(_COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * _COPY_BYTES / _best_time(lambda: (dst.copy_(src), sync()))


def measured_kinds(kind: str | None, device: torch.device | str = "cpu") -> tuple[str, ...]:
    """`kind` alone when known; else every GEMM kind worth measuring on `device` (fp16 is
    emulated on most CPUs and would only be slow, never the max)."""
    if kind is not None:
        return (kind,)
    if torch.device(device).type == "cuda":
        return tuple(GEMM_DTYPES)
    return ("fp32", "bf16", "int8")


def measure_peaks(device: torch.device | str = "cpu", kind: str | None = "fp32",
                  kinds: Iterable[str] | None = None) -> MachinePeaks:
    """Copy bandwidth and the GEMM peak(s) MFU is measured against on `device`.

    `kind` is the path's compute kind (`llm_peak_kind`); None measures every kind and
    takes the largest, so the MFU of a path of unknown kind is a lower bound.
    """
    kinds = tuple(kinds) if kinds is not None else measured_kinds(kind, device)
    gemm = {k: measure_gemm(k, device) for k in kinds}
    return MachinePeaks(measure_bandwidth(device), gemm, kind)


def weight_bytes_and_params(llm: LLM) -> tuple[int, int]:
    """Bytes and count of the weights one decode step reads (shared tensors once).

    Counts parameters and weight buffers (int8 weights and scales), not the rotary tables,
    and not the embedding table's own tensors when a separate LM head exists (a step reads
    only its rows); tensors the embedding shares with the head (tied) are counted.
    """
    model = llm.engine.loaded.model
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = {id(t): t for n, t in named if "rotary" not in n}
    embed = getattr(model.model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if embed is not None and head is not None:
        in_head = {id(t) for t in _module_tensors(head)}
        for t in _module_tensors(embed):
            if id(t) not in in_head:
                tensors.pop(id(t), None)
    unique = tensors.values()
    return sum(t.numel() * t.element_size() for t in unique), sum(t.numel() for t in unique)


def expert_weights(llm: LLM) -> tuple[int, int, float]:
    """A mixture of experts' expert weights: (bytes, parameters, share a token runs:
    top_k / num_experts); (0, 0, 1.0) for a dense model."""
    from llmserve.models.moe import SparseMoeBlock

    blocks = [m for m in llm.engine.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    tensors = {id(t): t for block in blocks for t in _module_tensors(block.experts)}
    share = blocks[0].top_k / blocks[0].num_experts if blocks else 1.0
    return (sum(t.numel() * t.element_size() for t in tensors.values()),
            sum(t.numel() for t in tensors.values()), share)


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _kv_bytes_per_token(llm: LLM) -> int:
    c = llm.engine.loaded.config
    kv_dtype = getattr(llm.engine, "kv_cache_dtype", llm.engine.dtype)
    element = torch.empty((), dtype=kv_dtype).element_size()  # scales of an int8 KV not counted
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * element  # K and V


def _attention_flops(llm: LLM, query_tokens: int, context: float) -> float:
    c = llm.engine.loaded.config
    return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * query_tokens * context


def run_latency(llm: LLM, batch: int, input_len: int, output_len: int,
                seed: int = 0, repeats: int = 1,
                bandwidth: Callable[[], float] | None = None) -> LatencyResult:
    """Prefill of `batch` prompts (wall clock) and the decode TPOT of `batch` streams: the
    median over `repeats` decode runs (fresh prompts each), which a shared machine's noise
    moves less than one run. `bandwidth`, when given, is measured right after each run."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    prefill_prompts = synthetic_prompts(llm, batch, input_len, seed=2 * seed + 1)
    start = time.perf_counter()
    llm.generate(prefill_prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill_s = time.perf_counter() - start
    runs, bandwidths = [], []
    for r in range(repeats):
        decode_prompts = synthetic_prompts(llm, batch, input_len,
                                           seed=2 * seed + 2 + 1000 * r)
        outputs = llm.generate(decode_prompts, SamplingParams(max_tokens=output_len, **greedy),
                               use_tqdm=False)
        tpots = [o.metrics.time_per_output_token for o in outputs]
        runs.append(sum(tpots) / len(tpots))
        if bandwidth is not None:
            bandwidths.append(bandwidth())
    tpot_s = statistics.median(runs)
    weights, num_params = weight_bytes_and_params(llm)
    # a mixture's step reads the experts its tokens chose (uniform routing: each expert is
    # missed by all `batch` tokens with probability (1 - share) ** batch) and a token
    # computes `share` of the experts' parameters
    expert_bytes, expert_params, share = expert_weights(llm)
    weights -= expert_bytes * (1 - share) ** batch
    num_params -= round(expert_params * (1 - share))
    mean_context = input_len + output_len / 2
    return LatencyResult(
        batch=batch, input_len=input_len, output_len=output_len, prefill_s=prefill_s,
        tpot_s=tpot_s,
        bytes_per_step=weights + batch * mean_context * _kv_bytes_per_token(llm),
        decode_flops_per_step=2 * num_params * batch
        + _attention_flops(llm, batch, mean_context),
        prefill_flops=2 * num_params * batch * input_len
        + _attention_flops(llm, batch * input_len, input_len / 2),
        tpot_runs_s=tuple(runs) if repeats > 1 else (),
        bandwidth_runs=tuple(bandwidths),
    )


def format_table(results: list[LatencyResult], peaks: MachinePeaks, llm: LLM | None = None,
                 machine: dict[str, Any] | None = None) -> str:
    lines = [format_machine(machine), *([format_path(path_info(llm))] if llm else []),
             f"peak copy bandwidth {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
             f"{peaks.flops_label} {peaks.flops_per_s / 1e9:.1f} GFLOP/s",
             f"{'batch':>6}{'prefill ms':>12}{'prefill MFU':>13}{'TPOT ms':>10}{'tok/s':>9}"
             f"{'MB/step':>9}{'MBU':>8}{'dec MFU':>9}"]
    ratios = []
    for r in results:
        ratios += [r.prefill_mfu(peaks), r.mbu(peaks), r.decode_mfu(peaks)]
        lines.append(f"{r.batch:>6}{1000 * r.prefill_s:>12.1f}"
                     f"{format_ratio(r.prefill_mfu(peaks)):>13}"
                     f"{1000 * r.tpot_s:>10.2f}{r.batch / r.tpot_s:>9.1f}"
                     f"{r.bytes_per_step / 1e6:>9.1f}{format_ratio(r.mbu(peaks)):>8}"
                     f"{format_ratio(r.decode_mfu(peaks)):>9}")
    spread = [r for r in results if r.tpot_runs_s]
    if spread:
        lines.append(f"TPOT: median of {len(spread[0].tpot_runs_s)} decode runs; per batch "
                     "min-max: " + ", ".join(
                         f"{r.batch}: {1000 * min(r.tpot_runs_s):.2f}-"
                         f"{1000 * max(r.tpot_runs_s):.2f} ms" for r in spread))
    paired = [bw for r in results for bw in r.bandwidth_runs]
    if paired:
        lines.append("MBU: each decode run against the copy bandwidth measured right after "
                     f"it ({min(paired) / 1e9:.1f}-{max(paired) / 1e9:.1f} GB/s), the median "
                     "over runs")
    if max(ratios) > 1.0:
        lines.append("* >100%: the path beat the measured peak, so the peak is underestimated "
                     "(e.g. a faster kernel than the benchmark GEMM); the ratio is not shown")
    return "\n".join(lines)


def report(llm: LLM, results: list[LatencyResult], peaks: MachinePeaks) -> dict[str, Any]:
    weights, num_params = weight_bytes_and_params(llm)
    return {"model": llm.engine.loaded.source.name, **path_info(llm),
            "num_threads": torch.get_num_threads(), "machine": machine_info(),
            "weight_bytes": weights, "num_params": num_params, **peaks.to_dict(),
            "runs": [r.to_dict(peaks) for r in results]}
