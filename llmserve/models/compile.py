"""The model step under `torch.compile`, one decoder layer compiled for all, cached on disk.

`compile_model` compiles the decoder layer's forward once (`torch.compile(dynamic=True)`)
and gives every layer of the stack that one compiled function (regional compilation:
dynamo treats the layer's parameters as inputs, so all layers share one graph; the
embedding, the rotary lookup, the final norm, the logits head and sampling stay eager).
The token count T, batch size and block-table width are symbolic, so one compiled
artefact serves prefill chunks, decodes and mixed steps alike (no per-shape buckets, no
recompile at T == 1). Inside the graph the native kernels that dynamo cannot trace
(ctypes) are torch custom ops (`llmserve::kv_cache_write`, mutating the cache in place, and
`llmserve::paged_attention`, see `layers/attention/native.py`); the elementwise work between the
matmuls (RMSNorm, rotary, SiLU-and-mul, residual adds) is fused by inductor.

Artefacts go to inductor's FX graph and AOTAutograd caches under
`~/.cache/llmserve/inductor` (`$LLMSERVE_CACHE/inductor`; `TORCHINDUCTOR_CACHE_DIR` wins if
set), so a second start only re-traces (dynamo, one layer) and loads the compiled code.
`Engine` compiles at start-up with one warm-up step (`warm_up`), not on the first request.

When compile is used:
* never with `enforce_eager=True` (`--enforce-eager`), nor with `LLMSERVE_ENFORCE_EAGER=1`;
* never where the step runs native kernels other than attention: the one-call decoder
  stack (`models/llama_native.py`: the int8/int4 default path, and float32 on CPUs with
  AVX-512, whose linears are packed for the native GEMM, `quantization/packed_float.py`), and
  quantized or packed linears. So compile is for bfloat16, float32 where the native
  GEMM does not run (no AVX-512, `LLMSERVE_NATIVE_KERNELS=0`), and CUDA;
* never for a mixture of experts (`models/moe.py`: which experts run depends on the data);
* never without a compiler (a C++ compiler on the CPU, triton on CUDA): one warning, eager;
* if compiling fails, one warning and the step runs eagerly from then on.

One layer or the whole stack (SmolLM2-135M, 30 layers, float32 on torch's GEMM with the
native attention, 2 cores; `LLM(...)` constructed to ready, then generate):
* compile at start-up, warm cache: 2.1 s one layer, 6.0 s the whole stack (dynamo
  re-traced all 30 layers); cold cache 4.4 s vs 35 s;
* step times equal within noise: 300-token prefill 0.42 vs 0.40 s (eager 0.51-0.53),
  64 tokens at batch 1 3.0-3.3 vs 2.8-2.9 s (eager 2.7-2.9), at batch 8 6.5-6.9 vs 6.0-6.6 s
  (eager 5.3-6.4).

Earlier measurements of the whole-stack compile (SmolLM2-135M, float32 per-op path, 2 cores
shared with other jobs, so ranges):
* compile at start-up: 56 s cold, 8 s warm (`llmserve serve --dtype float32` with
  `LLMSERVE_NATIVE_KERNELS=0`: start-to-healthy 63 s cold, 15-16 s warm, 4 s eager);
* `benchmarks/offline.py --dtype float32` (32 prompts x 64 tokens), native kernels off:
  81-83 tok/s compiled, 73-83 eager; `llmserve bench latency --dtype float32`: batch-1
  TPOT 57-59 ms both ways, batch 8 191-212 ms both ways (noise exceeds any difference);
* one step, compiled vs eager alternating in one process (min of 40), native attention:
  batch-1 decode 37 vs 35 ms, batch-32 decode 122 vs 136 ms, 128-token prefill 275 vs
  403 ms. So: on for float32, where batches and prompts gain 10-30 %;
* bfloat16 on the CPU (AVX512-BF16): batch 1/8/32 decode 46/27/56 vs 44/27/58 ms, prefill
  157 vs 122 ms: no gain, so off.
With inductor's C++ kernels on torch's OpenMP threads the batch-1 step took 161 ms (OpenMP
wake-ups under `OMP_WAIT_POLICY=PASSIVE`), hence `cpp.threads=1` below.
"""

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmserve.config.paths import cache_root

logger = logging.getLogger(__name__)

ENFORCE_EAGER_ENV = "LLMSERVE_ENFORCE_EAGER"


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> Path:
    """Where inductor's caches go: `$TORCHINDUCTOR_CACHE_DIR` where the user set it, else
    under llmserve's cache root. (Importing dynamo sets the variable to torch's default
    folder, which counts as not set.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return cache_root() / "inductor"


@functools.cache
def _use_inductor_cache_dir() -> None:
    """Point inductor at `inductor_cache_dir()` while dynamo compiles, and put the variable
    back as it was after: inductor takes its cache folder from the environment only, and
    llmserve does not leave the process's environment changed. Installed once per process
    (dynamo runs these callbacks around the outermost of nested compiles)."""
    from torch._dynamo.callback import on_compile_end, on_compile_start

    saved: list[str | None] = []  # the variable's value before the compile in progress

    @on_compile_start
    def _point(_: Any) -> None:
        saved[:] = [os.environ.get(INDUCTOR_CACHE_ENV)]
        os.environ[INDUCTOR_CACHE_ENV] = str(inductor_cache_dir())

    @on_compile_end
    def _restore(_: Any) -> None:
        if not saved:
            return
        value = saved.pop()
        if value is None:
            os.environ.pop(INDUCTOR_CACHE_ENV, None)
        else:
            os.environ[INDUCTOR_CACHE_ENV] = value


class CompiledForward:
    """A forward under `torch.compile`, falling back to the eager forward for good the first
    time compiling (or running compiled code) raises."""

    def __init__(self, eager_forward: Any, device: torch.device) -> None:
        self.eager_forward = eager_forward
        # On the CPU inductor's own kernels (the fused elementwise work between matmuls)
        # run on one thread: OpenMP regions woken per kernel under llmserve's PASSIVE wait
        # policy cost more than these small kernels (batch-1 decode step measured 161 ms
        # with them, 36 ms without; the matmuls keep torch's threads).
        options = {"cpp.threads": 1} if device.type == "cpu" else None
        self.compiled = torch.compile(eager_forward, dynamic=True, options=options)
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.failed:
            return self.eager_forward(*args, **kwargs)
        try:
            with _trace_settings():
                return self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eagerly
            self.failed = True
            logger.warning("torch.compile of the model step failed, running it eagerly: %s",
                           _first_line(exc))
            return self.eager_forward(*args, **kwargs)


def _trace_settings() -> Any:
    """Dynamo settings that keep one graph: sizes 1 are not special (a decode of one token
    uses the graph traced for a prefill), no duck sizing (T equal to the batch size is a
    coincidence), and float attributes (eps, scale) are constants, not graph inputs."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    patch = fx_config.patch(backed_size_oblivious=True, use_duck_shape=False)
    return _Both(patch, dynamo_config.patch(specialize_float=True))


class _Both:
    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def missing_compiler(device: torch.device) -> str | None:
    """Why inductor cannot generate code for `device` here, or None."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not installed"
    compiler = os.environ.get("CXX", "g++")
    return None if shutil.which(compiler) else f"no C++ compiler ({compiler})"


def compile_model(model: nn.Module, device: torch.device | str, quantization: str | None,
                  enforce_eager: bool = False) -> bool:
    """Compile `model`'s step in place where it helps (see the module docstring); returns
    whether it did. The compile itself happens on the first call (see `warm_up`)."""
    device = torch.device(device)
    if enforce_eager or os.environ.get(ENFORCE_EAGER_ENV, "0") == "1":
        logger.info("model step: eager (enforce_eager)")
        return False
    if quantization is not None or not _runs_torch_ops(model):
        logger.info("model step: eager (its weights run native kernels)")
        return False
    dtype = next(model.parameters()).dtype
    if device.type == "cpu" and dtype != torch.float32:
        logger.info("model step: eager (%s on the CPU: compile measured no faster)", dtype)
        return False
    reason = missing_compiler(device)
    if reason is not None:
        logger.warning("torch.compile unavailable (%s): the model step runs eagerly", reason)
        return False
    vision = getattr(getattr(model, "config", None), "vision", None)
    if vision is not None and vision.images_attend_both_ways:
        # the steps that hold an image add its two-way attention per op (its spans are
        # per-step Python lists, which dynamo would specialize the graph on)
        logger.info("model step: eager (an image's tokens attend to each other both ways)")
        return False
    if getattr(getattr(model, "config", None), "moe", None) is not None:
        # each step's tokens pick their experts: a data-dependent loop dynamo cannot trace
        logger.info("model step: eager (a mixture of experts routes each step's tokens)")
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        logger.info("model step: eager (no decoder layers to compile)")
        return False
    _use_inductor_cache_dir()
    try:
        shared = CompiledForward(type(layers[0]).forward, device)
    except Exception as exc:  # noqa: BLE001 - no usable compiler: run eagerly
        logger.warning("torch.compile unavailable, the model step runs eagerly: %s",
                       _first_line(exc))
        return False
    for layer in layers:
        layer.forward = functools.partial(shared, layer)
    model.compiled_layers = shared  # the model looks its rotary tables up before the layers
    return True


def _runs_torch_ops(model: nn.Module) -> bool:
    """Whether the step is torch ops that inductor can compile: no one-call native stack,
    and every linear and the embedding on torch's own kernels (the packed float32 and
    quantized methods call native kernels, which would break the graph)."""
    from llmserve.layers.embedding import Embedding
    from llmserve.layers.linear import Linear, LinearMethod

    if getattr(model, "native_layers", None) is not None:
        return False
    for module in model.modules():
        if isinstance(module, Linear) and type(module.method) is not LinearMethod:
            return False
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embedding is None or type(embedding) is Embedding


def is_compiled(model: nn.Module) -> bool:
    compiled = getattr(model, "compiled_layers", None)
    return isinstance(compiled, CompiledForward) and not compiled.failed


@torch.inference_mode()
def warm_up(model: nn.Module, kv_cache: Any, backend: Any) -> None:
    """Compile now: one two-token step through block 0 of `kv_cache`, whose contents are
    put back afterwards (the step's shapes are symbolic, so this one graph serves all)."""
    if not is_compiled(model):
        return
    from llmserve.layers.attention.backend import AttentionMetadata

    start = time.perf_counter()
    device = kv_cache.key[0].device
    saved = [t[0].clone() for t in _cache_tensors(kv_cache)]
    meta = AttentionMetadata.build([2], [0], [[0]], kv_cache.block_size, device, backend)
    ids = torch.zeros(2, dtype=torch.long, device=device)
    model(ids, torch.arange(2, device=device), kv_cache, meta)
    for tensor, block in zip(_cache_tensors(kv_cache), saved, strict=True):
        tensor[0].copy_(block)
    if is_compiled(model):
        logger.info("model step compiled in %.1fs (cache: %s)", time.perf_counter() - start,
                    inductor_cache_dir())


def _cache_tensors(kv_cache: Any) -> list[torch.Tensor]:
    return [*kv_cache.key, *kv_cache.value, *(kv_cache.key_scales or []),
            *(kv_cache.value_scales or [])]
