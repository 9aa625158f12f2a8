"""What `quantization="auto"` runs on this CPU, and where decodes prefetch their weights:
chosen by timing, not by CPU flags (the attention backend: attention_choice.py).

A quantized checkpoint could run its linears in its own format (a 4-bit one as int4-a8 or
int4, int8, a GGUF file's own blocks) on the native kernels, in another (int8) or as
float32. The first start of a model on a machine times each candidate on the model's own
shapes (every layer's qkv, o, gate_up and down, and the LM head in the format the engine
gives it) at batch 1 (decode alone) and at batch 32 (a serving batch), in interleaved rounds
on the wall and CPU clocks (`quiet_timing.py`), and keeps the default for the checkpoint's
format (CANDIDATES' first) unless another is clearly faster at the serving batch in every
round and not slower at batch 1 (`pick`). The decision is cached beside the kernel
builds, keyed by the CPU, its flags, the kernel level and sources, torch's version and the
shapes: a warm start reads it and times nothing.

A timing taken while the machine was busy decides nothing (a first start beside a compile
job once cached float32, 3-4x slower, for good): that start runs that default (attention:
native; decode prefetch: into the caches), caches nothing, and a later quiet start
decides; within the process the busy answer holds (decision_cache.py). Every
decision is logged at start with its source (measured, cached, busy); `llmserve bench
kernels` prints every kernel's times, and `--retime` decides again by hand.
"""

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmserve.config.model import ModelConfig
from llmserve.loader import decision_cache
from llmserve.loader.quiet_timing import Timing, Unit, time_rounds

logger = logging.getLogger(__name__)

BATCHES = (1, 32)
# candidates for a checkpoint stored as int4 / kquant / int8, its default first (what a busy
# start runs), then the others in the order they are preferred (None: float32). A 4-bit
# checkpoint's default is int4-a8, 8-bit activations as llama.cpp's, not int4's 15 bits: see
# SERVING_MARGIN for why, and why the order is not left to the timing.
CANDIDATES: dict[str, tuple[str | None, ...]] = {"int4": ("int4-a8", "int4", "int8", None),
                                                 "kquant": ("kquant", "int8", None),
                                                 "int8": ("int8", None)}
# Another format replaces the checkpoint's own only where it is at least SERVING_MARGIN
# times as fast at the serving batch in every round, on both clocks. The margin covers:
# - float32's flattery: one matrix timed alone keeps float32's weights hot in the caches
#   at batch 32, where the model's 538 MB stream past. At AVX2 int4 (its int8 head
#   included) timed 0.92-1.09x float32 over four runs while the whole engine decoded 32
#   streams 1.11x faster on int4 (`bench latency`: 110 vs 122 ms a step): float32 must
#   time more than ~1.2x faster here to be faster in the engine.
# - int4-a8's quality: 8-bit activations cost +0.35-0.44 % perplexity against float32
#   where int4's 15 bits give -0.01 % (quantization/int4.py), worth it only for a clear
#   gain. Half the integer work: it timed 1.67x int4 at AVX2 without VNNI (28.8 vs 48.1 ms
#   a step at batch 32) and 1.56x at avx512+vnni (12.1 vs 18.9), but on the default model's
#   shapes at AVX2 (Zen 3) 1.31x in its best times and 1.02-1.3x in its worst round: on the
#   margin, and first starts there flipped between the two (`llmserve bench startup`, two
#   runs). So int4-a8 is the 4-bit default, never slower at batch 1 (3.50 vs 3.51 ms at
#   avx512+vnni, 3.46 vs 4.35 at AVX2) and faster at every serving batch timed, and int4
#   would replace it only where it led by the margin (nowhere timed): the same format on
#   every start of a machine, busy or quiet. (The rule before compared int4 with float32:
#   it kept int4 at avx512+vnni and flipped between the two at AVX2.)
SERVING_MARGIN = 1.25
# ...and not slower at batch 1 than the own format by more than this in its best times
# (both clocks). The int4 variants stream the same bytes there and time alike (int4-a8
# 3.50 vs int4 3.51 ms at avx512+vnni, 3.46 vs 4.35 at AVX2): with each best time ~5 % from
# the truth, two equal times can be 10 % apart, and a tighter bound would let batch 1's
# noise pick between them. float32 streams 8x int4's bytes and times 2-3x slower.
BATCH1_TOLERANCE = 0.10
# a round's time for each (candidate, batch, shape); the default model: 3 rounds in 0.8 s,
# 1.9 s with making and packing the weights (2.0 s before rounds)
_TIME_PER_UNIT_S = 0.004


@dataclass(frozen=True)
class KernelChoice:
    quantization: str | None  # what the linears run (None: float32)
    ms: dict[str, dict[int, float]]  # candidate ("float32" for None) -> batch -> best ms a step
    source: str  # "measured", "cached", or "busy" (the own format, not cached)
    why: str  # the rule's reason, or the machine's load when busy
    decision_file: Path | None = None  # where it is cached (None: busy, not cached)

    @property
    def cached(self) -> bool:
        return self.source == "cached"

    def describe(self) -> str:
        cells = "; ".join(
            f"{name} " + " / ".join(f"{ms[b]:.1f}" for b in BATCHES)
            for name, ms in self.ms.items())
        figures = f"ms a step's linears at batch {' / '.join(map(str, BATCHES))}: {cells}"
        if self.source == "busy":
            return (f"auto runs {self.quantization}: the machine was busy while timing "
                    f"({self.why}): running the default for the checkpoint's format, "
                    f"{self.quantization}; not cached, a quiet start decides ({figures})")
        return (f"auto runs {self.quantization or 'float32'} ({self.source}; {self.why}; "
                f"{figures})")


def linear_shapes(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(out_features, in_features, count) of one step's linears, the LM head last. A
    mixture's sparse layers count the experts a token runs (top_k), and its shared expert."""
    hidden, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    layers = config.num_hidden_layers
    moe = config.moe
    sparse = sum(config.is_moe_layer(i) for i in range(layers))
    mlps = [(config.intermediate_size, layers - sparse)]
    if moe is not None:
        mlps += [(moe.intermediate_size, sparse * moe.top_k),
                 (moe.shared_intermediate_size, sparse if moe.shared_intermediate_size else 0)]
    shapes = [((heads + 2 * kv) * d, hidden, layers), (hidden, heads * d, layers)]
    for width, count in mlps:
        if count:
            shapes += [(2 * width, hidden, count), (hidden, width, count)]
    return shapes + [(config.vocab_size, hidden, 1)]


def choose_quantization(stored: str | None, config: ModelConfig, block_type: str = "Q4_K",
                        retime: bool = False) -> KernelChoice | None:
    """The linears' format for a checkpoint stored as `stored` on this CPU (native kernels
    present), from the cache or timed now; None when there is nothing to choose. A file
    on its own blocks ("kquant") is timed in `block_type`, the GGUF type of most of its
    bytes. `retime`: time now whatever is cached, and replace the cached decision unless
    the machine is busy (`llmserve bench kernels --retime`)."""
    candidates = CANDIDATES.get(stored or "")
    if candidates is None:
        return None
    shapes = linear_shapes(config)
    path = decision_cache.cache_path("choice", [stored, json.dumps(shapes),
                                                json.dumps(CANDIDATES), str(BATCHES), block_type])
    if not retime:
        if (held := decision_cache.busy_decision(path)) is not None:
            return held
        if (cached := cached_choice(path)) is not None:
            return cached
    from llmserve.kernels import native

    # Each matrix is timed over and over: with the decode's weights prefetched into the
    # caches, as float32's always are, so that formats are compared alike (non-temporal,
    # the int formats re-read memory each call here: int4 timed 11.9 ms at batch 1 against
    # float32's 8.1 on a 480 MiB-L3 Xeon). The model's own prefetch is chosen after it
    # loads (choose_stream_prefetch).
    native().set_stream_prefetch(0)  # the library's default
    start = time.perf_counter()
    timing = time_candidates(candidates, shapes, block_type)
    logger.info("timed the linear kernels in %.1f s (%s)", time.perf_counter() - start,
                timing.summary())
    if (busy := timing.busy_reason()) is not None:
        choice = KernelChoice(candidates[0], timing.best(), "busy", busy)
        return choice if retime else decision_cache.hold_busy(path, choice)
    chosen = pick(candidates, timing)
    choice = KernelChoice(chosen, timing.best(), "measured", _why(candidates, timing), path)
    decision_cache.write(path, {"quantization": chosen, "ms": choice.ms, "why": choice.why})
    return choice


def cached_choice(path: Path) -> KernelChoice | None:
    """The decision cached at `path`, if one is."""
    saved = decision_cache.read(path)
    if saved is None or not {"quantization", "ms", "why"} <= saved.keys():
        return None
    ms = {name: {int(b): t for b, t in times.items()} for name, times in saved["ms"].items()}
    return KernelChoice(saved["quantization"], ms, "cached", saved["why"], path)


def pick(candidates: tuple[str | None, ...], timing: Timing) -> str | None:
    """The default for the checkpoint's format (the first candidate) unless another is
    clearly faster: SERVING_MARGIN times as fast at the serving batch in every round on
    both clocks, and within BATCH1_TOLERANCE of it at batch 1 in the best times; the first
    such, in CANDIDATES' order. One rule for every format, float32 included."""
    own = _name(candidates[0])
    serving = BATCHES[-1]

    def clearly_faster(name: str) -> bool:
        return (timing.lead(name, own, serving) >= SERVING_MARGIN
                and all(best[name][BATCHES[0]] <= best[own][BATCHES[0]] * (1 + BATCH1_TOLERANCE)
                        for best in timing.bests()))

    return next((c for c in candidates[1:] if clearly_faster(_name(c))), candidates[0])


def _why(candidates: tuple[str | None, ...], timing: Timing) -> str:
    own, serving = _name(candidates[0]), BATCHES[-1]
    leads = ", ".join(f"{_name(c)} {timing.lead(_name(c), own, serving):.2f}x"
                      for c in candidates[1:])
    return (f"{len(timing.wall)} rounds; at batch {serving} the worst round's speed against "
            f"{own}: {leads}; another format needs {SERVING_MARGIN}x and batch 1 within "
            f"{BATCH1_TOLERANCE:.0%}")


# The rows a matrix is timed on at most: an LM head of a 128k vocabulary (Llama 3's) is
# timed on its first quarter, still far past the caches (256 MB in float32, 64 MB in int8)
# as the whole is; making and packing all of it in float32, int8 and a K-quant was most of
# a 1B model's first start.
MAX_TIMED_ROWS = 32768


def time_candidates(candidates: tuple[str | None, ...], shapes: list[tuple[int, int, int]],
                    block_type: str = "Q4_K") -> Timing:
    """Milliseconds for one step's linears per candidate and batch, in rounds
    (`quiet_timing.time_rounds`): each shape's weight is made once and packed once per
    format (the LM head is int8 under every int format: QUANTIZED_HEADS), then every
    (candidate, batch, shape) is timed in every round and counted once per layer that runs
    it. Making and packing the weights cost more than the timing itself (1.3 s of 3.0 when
    each timing made its own). A matrix taller than MAX_TIMED_ROWS is timed on that many
    rows and counted in proportion."""
    generator = torch.Generator().manual_seed(0)
    units = []
    for i, (n, k, count) in enumerate(shapes):
        timed = min(n, MAX_TIMED_ROWS)
        count *= n / timed
        base = torch.empty(min(timed, _RANDOM_ROWS), k).uniform_(-0.1, 0.1, generator=generator)
        rows = {b: torch.empty(b, k).uniform_(-1, 1, generator=generator) for b in BATCHES}
        head = i == len(shapes) - 1
        kernels = {}
        for candidate in candidates:
            kind = "int8" if head and candidate not in (None, "kquant") else candidate
            if kind == "kquant" and k % 256:
                kind = "int8"  # a file stores such a matrix in another type: the fallback
            if kind not in kernels:
                kernels[kind] = _kernel(kind, base, timed, block_type)
            units += [Unit(_name(candidate), b, functools.partial(kernels[kind], rows[b]), count)
                      for b in BATCHES]
    return time_rounds(units, _name(candidates[0]), _TIME_PER_UNIT_S)


# A timed weight is this many random rows repeated (the kernels' speed does not depend on
# the values): drawing and quantizing every row of a 1B model's shapes took 1.4 s of its
# first start's 3.7 s of timing. The float32 and int8 weights are packed from these rows
# once and their packed rows repeated (packing them all was 0.9 s more).
_RANDOM_ROWS = 512


def _tiled(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`rows` repeated down to `n` rows."""
    return rows.repeat(-(-n // rows.shape[0]), *(1,) * (rows.dim() - 1))[:n].contiguous()


def _kernel(quantization: str | None, base: torch.Tensor, n: int, block_type: str = "Q4_K"):
    """x -> y for a weight of `n` rows, `base` repeated down, packed in `quantization`'s
    format ("kquant": random blocks of GGUF type `block_type` of that shape)."""
    from llmserve.quantization.int4 import PackedInt4Weight, int4_linear
    from llmserve.quantization.int8 import PackedInt8Weight, int8_linear, quantize_rows
    from llmserve.quantization.packed_float import PackedFloatWeight, float_linear

    whole_repeats = n % len(base) == 0 and len(base) % 16 == 0  # whole blocks of channels
    if quantization == "kquant":
        from gguf import GGMLQuantizationType as QT

        from llmserve.quantization.kquant import PackedKQuantWeight, kquant_linear, random_blocks

        blocks = random_blocks(QT[block_type], n, base.shape[1], np.random.default_rng(0))
        packed = PackedKQuantWeight([blocks])
        return lambda x: kquant_linear(x, packed)
    if quantization in ("int4", "int4-a8"):
        packed = PackedInt4Weight(_tiled(base, n),
                                  activation_bits=8 if quantization == "int4-a8" else 15)
        return lambda x: int4_linear(x, packed)
    if quantization == "int8":
        if whole_repeats:
            packed = PackedInt8Weight.from_codes(*quantize_rows(base)).repeated(n // len(base))
        else:
            codes, scale = quantize_rows(base)
            packed = PackedInt8Weight.from_codes(_tiled(codes, n), _tiled(scale, n))
        return lambda x: int8_linear(x, packed)
    if whole_repeats:
        packed = PackedFloatWeight(base).repeated(n // len(base))
    else:
        packed = PackedFloatWeight(_tiled(base, n))
    return lambda x: float_linear(x, packed)


def _name(quantization: str | None) -> str:
    return quantization or "float32"


def choose_stream_prefetch(model: torch.nn.Module) -> str | None:
    """Times decode passes over the model's own packed weights (batch 1, in layer order, as
    a step reads them) with the weights prefetched non-temporally and into the caches, in
    rounds, sets the library to prefetch them non-temporally where that was faster in the
    median round by NONTEMPORAL_MARGIN (else into the caches, its default) and says what it
    chose (None: no packed weights). Non-temporal won 1.04x on a Zen 5 (32 MiB L3); the
    caches won 1.6-2.6x on a Xeon VM (480 MiB L3). About 0.4 s at a first start; cached
    like the other
    choices (keyed by the weights' formats and shapes), so a warm start times nothing; a
    busy machine keeps the default and caches nothing."""
    from llmserve.kernels import native
    from llmserve.layers.linear import PackedHead, PackedLinearMethod

    lib = native()
    linears = []
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, PackedLinearMethod) and hasattr(method.weight, "in_features"):
            linears.append((type(method).compute, method.weight))
        elif isinstance(module, PackedHead) and hasattr(module.weight, "in_features"):
            linears.append((module._linear, module.weight))
    if lib is None or not linears:
        return None
    path = decision_cache.cache_path("prefetch", [
        json.dumps([(type(w).__name__, getattr(w, "activation_bits", 0), w.out_features,
                     w.in_features) for _, w in linears])])
    nontemporal, ms, source = (decision_cache.busy_decision(path) or _cached_prefetch(path)
                               or _decide_stream_prefetch(lib, linears, path))
    lib.set_stream_prefetch(nontemporal)
    return (f"decode prefetch: {'non-temporal' if nontemporal else 'into the caches'} "
            f"({source}; one pass over the weights {ms['non-temporal']:.2f} ms non-temporal, "
            f"{ms['cached']:.2f} ms cached)")


# Weights are prefetched non-temporally only where that is this much faster in the median
# round: the most it ever gained was 1.04x (a Zen 5's engine step, 32 MiB L3), where
# keeping them cached lost 1.8x on a Xeon (a 1B Q4_K_M's pass 17.6 ms non-temporal against
# 9.6) and 1.00-1.07x either way on a Zen 3. So the caches are the default, the choice a
# busy start keeps, and what a lead within the margin keeps. The median round, not "every
# round" as a format must lead: one round that a neighbour slowed (a `curl` polling the
# health beside a first start) must not decide either way.
NONTEMPORAL_MARGIN = 1.10


def _cached_prefetch(path: Path) -> tuple[int, dict[str, float], str] | None:
    saved = decision_cache.read(path)
    if saved is None or not {"nontemporal", "ms"} <= saved.keys():
        return None
    return saved["nontemporal"], saved["ms"], "cached"


def _decide_stream_prefetch(lib, linears, path: Path) -> tuple[int, dict[str, float], str]:
    start = time.perf_counter()
    timing = _time_stream_prefetch(lib, linears)
    logger.info("timed the decode prefetch in %.1f s (%s)", time.perf_counter() - start,
                timing.summary())
    ms = {row: times["pass"] for row, times in timing.best().items()}
    if (busy := timing.busy_reason()) is not None:
        return decision_cache.hold_busy(path, (0, ms, (
            f"the default: the machine was busy while timing ({busy}); not cached, a quiet "
            "start decides")))
    nontemporal = int(
        timing.median_lead("non-temporal", "cached", "pass") >= NONTEMPORAL_MARGIN)
    decision_cache.write(path, {"nontemporal": nontemporal, "ms": ms})
    return nontemporal, ms, "measured"


# Passes a round take about this long for each prefetch, and the round counts the fastest:
# with one pass a round (~10 ms for a 1B model), a `curl` polling the server's health beside
# a first start (0.3 cores) took single rounds of the cached prefetch's 1.8x lead to 1.09x.
_PREFETCH_PASSES_S = 0.05


def _time_stream_prefetch(lib, linears) -> Timing:
    """Passes over `linears` in rounds with the weights prefetched non-temporally and into
    the caches; each after an untimed pass, which finds the caches as the other left them."""
    rows = {id(w): torch.zeros(1, w.in_features) for _, w in linears}

    def one_pass():
        for compute, weight in linears:
            compute(rows[id(weight)], weight)

    def switch(nontemporal: int):
        lib.set_stream_prefetch(nontemporal)
        one_pass()

    units = [Unit(row, "pass", one_pass, before=functools.partial(switch, nontemporal),
                  fastest_call=True)
             for row, nontemporal in (("cached", 0), ("non-temporal", 1))]
    return time_rounds(units, "cached", _PREFETCH_PASSES_S)


def stage_costs(config: ModelConfig, quantization: str | None, block_type: str = "Q4_K"
                ) -> tuple[list[float], float, str] | None:
    """Each decoder layer's and the LM head's milliseconds a step at the serving batch
    (BATCHES[-1]) in `quantization`'s kernels, timed on this CPU (cached as the kernel
    choice is; a busy machine's timing is not kept), and where they came from: a pipeline
    splits the layers by them (`distributed/pipeline.py`). The layers' share is timed on
    every linear shape a step runs and spread over the layers by their parameters (a
    mixture's sparse layers read their top_k experts). None without the native kernels."""
    from llmserve.distributed.pipeline import layer_costs
    from llmserve.kernels import native

    if native() is None:
        return None
    shapes = linear_shapes(config)
    kind = quantization if quantization in (None, "int8", "int4", "int4-a8", "kquant") \
        else None
    path = decision_cache.cache_path("stage-costs", [str(kind), json.dumps(shapes),
                                                     str(BATCHES), block_type])
    cached = decision_cache.read(path)
    if cached is not None:
        layers_ms, head_ms, source = cached["layers_ms"], cached["head_ms"], "cached"
    else:
        serving = BATCHES[-1]
        layers = time_candidates((kind,), shapes[:-1], block_type)
        head = time_candidates((kind,), shapes[-1:], block_type)
        layers_ms = layers.best()[_name(kind)][serving]
        head_ms = head.best()[_name(kind)][serving]
        busy = layers.busy_reason() or head.busy_reason()
        source = f"busy: {busy}" if busy else "measured"
        if busy is None:
            decision_cache.write(path, {"layers_ms": layers_ms, "head_ms": head_ms})
    params, _ = layer_costs(config)
    total = sum(params)
    return [layers_ms * p / total for p in params], head_ms, source
