"""`llmserve bench latency`: prefill time and decode TPOT per batch size, with MBU and MFU.

The machine's peaks are measured once: memory bandwidth as a large tensor copy (bytes read
+ bytes written per second) and compute as an fp32 GEMM. Decode at small batch is bound by
memory, so its yardstick is MBU::

    MBU = (weight bytes + KV bytes read per step) / TPOT / peak bandwidth

and prefill's (and large batches') is MFU = model FLOPs per second / peak FLOP/s.
"""

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from llmserve.bench.throughput import synthetic_prompts
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

_COPY_BYTES = 512 * 2**20
_GEMM_SIZE = 2048
_REPEATS = 5


@dataclass(frozen=True)
class MachinePeaks:
    bandwidth_bytes_per_s: float
    flops_per_s: float


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

    def mbu(self, peaks: MachinePeaks) -> float:
        return self.bytes_per_step / self.tpot_s / peaks.bandwidth_bytes_per_s

    def decode_mfu(self, peaks: MachinePeaks) -> float:
        return self.decode_flops_per_step / self.tpot_s / peaks.flops_per_s

    def prefill_mfu(self, peaks: MachinePeaks) -> float:
        return self.prefill_flops / self.prefill_s / peaks.flops_per_s

    def to_dict(self, peaks: MachinePeaks) -> dict[str, Any]:
        return {**asdict(self), "decode_tokens_per_s": self.batch / self.tpot_s,
                "mbu": self.mbu(peaks), "decode_mfu": self.decode_mfu(peaks),
                "prefill_mfu": self.prefill_mfu(peaks)}


def _best_time(fn: Any, repeats: int = _REPEATS) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(device: torch.device | str = "cpu") -> MachinePeaks:
    """Copy bandwidth (read + write bytes/s) and fp32 GEMM FLOP/s on `device`."""
    src = torch.ones(_COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    copy_s = _best_time(lambda: (dst.copy_(src), sync()))
    a = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    b = torch.randn(_GEMM_SIZE, _GEMM_SIZE, device=device)
    gemm_s = _best_time(lambda: (torch.mm(a, b), sync()))
    return MachinePeaks(bandwidth_bytes_per_s=2 * _COPY_BYTES / copy_s,
                        flops_per_s=2 * _GEMM_SIZE**3 / gemm_s)


def weight_bytes_and_params(llm: LLM) -> tuple[int, int]:
    """Bytes and count of the weights one decode step reads (shared tensors once).

    Counts parameters and weight buffers (int8 weights and scales), not the rotary tables,
    and not the embedding table when a separate LM head exists (a step reads only its rows).
    """
    model = llm.engine.loaded.model
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if "rotary" not in n)
    embedding = model.model.embed_tokens.weight
    if model.lm_head is not None:
        tensors = {n: t for n, t in tensors.items() if t is not embedding}
    unique = {id(t): t for t in tensors.values()}.values()
    return sum(t.numel() * t.element_size() for t in unique), sum(t.numel() for t in unique)


def _kv_bytes_per_token(llm: LLM) -> int:
    c = llm.engine.loaded.config
    element = torch.finfo(llm.engine.dtype).bits // 8
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * element  # K and V


def _attention_flops(llm: LLM, query_tokens: int, context: float) -> float:
    c = llm.engine.loaded.config
    return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * query_tokens * context


def run_latency(llm: LLM, batch: int, input_len: int, output_len: int,
                seed: int = 0) -> LatencyResult:
    """Prefill of `batch` prompts (wall clock) and the decode TPOT of `batch` streams."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    prefill_prompts = synthetic_prompts(llm, batch, input_len, seed=2 * seed + 1)
    start = time.perf_counter()
    llm.generate(prefill_prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill_s = time.perf_counter() - start
    decode_prompts = synthetic_prompts(llm, batch, input_len, seed=2 * seed + 2)
    outputs = llm.generate(decode_prompts, SamplingParams(max_tokens=output_len, **greedy),
                           use_tqdm=False)
    tpots = [o.metrics.time_per_output_token for o in outputs]
    tpot_s = sum(tpots) / len(tpots)
    weights, num_params = weight_bytes_and_params(llm)
    mean_context = input_len + output_len / 2
    return LatencyResult(
        batch=batch, input_len=input_len, output_len=output_len, prefill_s=prefill_s,
        tpot_s=tpot_s,
        bytes_per_step=weights + batch * mean_context * _kv_bytes_per_token(llm),
        decode_flops_per_step=2 * num_params * batch
        + _attention_flops(llm, batch, mean_context),
        prefill_flops=2 * num_params * batch * input_len
        + _attention_flops(llm, batch * input_len, input_len / 2),
    )


def format_table(results: list[LatencyResult], peaks: MachinePeaks) -> str:
    lines = [f"peak copy bandwidth {peaks.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
             f"fp32 GEMM {peaks.flops_per_s / 1e9:.1f} GFLOP/s",
             f"{'batch':>6}{'prefill ms':>12}{'prefill MFU':>13}{'TPOT ms':>10}{'tok/s':>9}"
             f"{'MB/step':>9}{'MBU':>7}{'dec MFU':>9}"]
    for r in results:
        lines.append(f"{r.batch:>6}{1000 * r.prefill_s:>12.1f}{r.prefill_mfu(peaks):>13.1%}"
                     f"{1000 * r.tpot_s:>10.2f}{r.batch / r.tpot_s:>9.1f}"
                     f"{r.bytes_per_step / 1e6:>9.1f}{r.mbu(peaks):>7.1%}"
                     f"{r.decode_mfu(peaks):>9.1%}")
    return "\n".join(lines)


def report(llm: LLM, results: list[LatencyResult], peaks: MachinePeaks) -> dict[str, Any]:
    weights, num_params = weight_bytes_and_params(llm)
    return {"model": llm.engine.loaded.source.name,
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "device": str(llm.engine.device), "num_threads": torch.get_num_threads(),
            "weight_bytes": weights, "num_params": num_params, **asdict(peaks),
            "runs": [r.to_dict(peaks) for r in results]}
