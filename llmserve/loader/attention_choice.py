"""What attention backend "auto" runs on this CPU: chosen by timing, as the linears' format
is (kernel_choice.py), with the same rounds, busy-machine rule and cache.

One backend serves prefill and decode alike: a query's output must not depend on which
phase computed it (prefix-cache hits, chunked prefill, preemption and speculative
verification all recompute or skip queries and rely on that). Each phase is timed on the
model's head shapes, over every layer: a serving batch's decode (32 sequences at context
256) and prefill (4 prompts of 128 tokens). The native kernel is kept unless torch's SDPA
is faster at both in every round (native also lets the decoder stack run as one native
call, which the per-phase times leave out); a busy machine keeps native and caches nothing.
"""

import functools
import logging
import time
from dataclasses import dataclass

import torch

from llmserve.config.model import ModelConfig
from llmserve.loader import decision_cache
from llmserve.loader.quiet_timing import Timing, Unit, time_rounds

logger = logging.getLogger(__name__)

ATTENTION_DECODE = (32, 256)  # sequences, context
ATTENTION_PREFILL = (4, 128)  # prompts, tokens each
PHASES = ("prefill", "decode")
_TIME_PER_UNIT_S = 0.01  # a round's time for each (backend, phase): ~0.03 s in all, as before


@dataclass(frozen=True)
class AttentionChoice:
    backend: str
    ms: dict[str, dict[str, float]]  # backend -> phase ("prefill", "decode") -> ms, all layers
    source: str  # "measured", "cached", or "busy" (native, not cached)
    why: str = ""  # the machine's load, where busy

    @property
    def cached(self) -> bool:
        return self.source == "cached"

    def describe(self) -> str:
        cells = "; ".join(f"{name} " + " / ".join(f"{t[p]:.1f}" for p in PHASES)
                          for name, t in self.ms.items())
        source = self.source
        if source == "busy":
            source = (f"the default: the machine was busy while timing ({self.why}); not "
                      "cached, a quiet start decides")
        return (f"attention: {self.backend} ({source}; ms over the layers for prefill "
                f"{ATTENTION_PREFILL[0]}x{ATTENTION_PREFILL[1]} / decode of "
                f"{ATTENTION_DECODE[0]} at context {ATTENTION_DECODE[1]}: {cells})")


def choose_attention(config: ModelConfig, kv_dtype: torch.dtype, retime: bool = False
                     ) -> AttentionChoice:
    """The CPU attention backend for `config`'s heads with a `kv_dtype` cache (native
    kernels present), from the cache or timed now. `retime`: time now whatever is cached,
    and replace the cached decision unless the machine is busy."""
    path = decision_cache.cache_path("attention", [
        config.architecture, str(config.num_attention_heads), str(config.num_key_value_heads),
        str(config.head_dim), str(config.num_hidden_layers), str(kv_dtype)])
    if not retime:
        if (held := decision_cache.busy_decision(path)) is not None:
            return held
        saved = decision_cache.read(path)
        if saved is not None and {"backend", "ms"} <= saved.keys():
            return AttentionChoice(saved["backend"], saved["ms"], "cached")
    start = time.perf_counter()
    timing = time_attention(config, kv_dtype)
    logger.info("timed the attention backends in %.1f s (%s)", time.perf_counter() - start,
                timing.summary())
    if (busy := timing.busy_reason()) is not None:
        choice = AttentionChoice("native", timing.best(), "busy", busy)
        return choice if retime else decision_cache.hold_busy(path, choice)
    choice = AttentionChoice(pick_attention(timing), timing.best(), "measured")
    decision_cache.write(path, {"backend": choice.backend, "ms": choice.ms})
    return choice


def pick_attention(timing: Timing) -> str:
    """native, unless torch is faster at both phases in every round, on both clocks."""
    if "torch" in timing.best() and all(timing.lead("torch", "native", phase) > 1
                                        for phase in PHASES):
        return "torch"
    return "native"


def time_attention(config: ModelConfig, kv_dtype: torch.dtype) -> Timing:
    """Milliseconds per backend and phase for one step's attention over every layer (the
    cache write included), in rounds (`quiet_timing.time_rounds`); torch only where it
    reads `kv_dtype` (not int8)."""
    from llmserve.layers.attention.backend import AttentionMetadata, TorchBackend
    from llmserve.layers.attention.native import NativeCPUBackend
    from llmserve.layers.kv_cache import KVCache

    heads, kv_heads, d = (config.num_attention_heads, config.num_key_value_heads,
                          config.head_dim)
    block_size = 16
    phases = {"decode": ([1] * ATTENTION_DECODE[0], [ATTENTION_DECODE[1]] * ATTENTION_DECODE[0]),
              "prefill": ([ATTENTION_PREFILL[1]] * ATTENTION_PREFILL[0],
                          [0] * ATTENTION_PREFILL[0])}
    blocks_each = -(-(max(ATTENTION_DECODE[1] + 1, ATTENTION_PREFILL[1])) // block_size)
    num_seqs = max(ATTENTION_DECODE[0], ATTENTION_PREFILL[0])
    cache = KVCache.allocate(1, num_seqs * blocks_each, block_size, kv_heads, d, kv_dtype)
    layer = cache.layer(0)
    generator = torch.Generator().manual_seed(0)
    for t in (layer.key, layer.value):  # written keys: the kernels read every visible slot
        t.copy_(torch.empty(t.shape).uniform_(-1, 1, generator=generator).to(t.dtype))
    backends = {"native": NativeCPUBackend()}
    if kv_dtype != torch.int8:
        backends["torch"] = TorchBackend()
    units = []
    for phase, (query_lens, context_lens) in phases.items():
        block_ids = [list(range(i * blocks_each, (i + 1) * blocks_each))
                     for i in range(len(query_lens))]
        tokens = sum(query_lens)
        q = torch.empty(tokens, heads, d).uniform_(-1, 1, generator=generator)
        k = torch.empty(tokens, kv_heads, d).uniform_(-1, 1, generator=generator)
        v = torch.empty(tokens, kv_heads, d).uniform_(-1, 1, generator=generator)
        for name, backend in backends.items():
            meta = AttentionMetadata.build(query_lens, context_lens, block_ids, block_size,
                                           backend=backend)
            units.append(Unit(name, phase, functools.partial(
                backend.forward, q, k, v, layer, meta, d ** -0.5), config.num_hidden_layers))
    return time_rounds(units, "native", _TIME_PER_UNIT_S)
