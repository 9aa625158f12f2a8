"""`llmserve memory`: a model's weight and KV-cache memory, with the arithmetic shown.

The KV-cache figures come from `llmserve.memory` (`kv_bytes_per_token`, `plan_kv_cache`),
the same functions the engine sizes its cache with, so the numbers printed are the ones
the engine will use.
"""


import torch

from llmserve.config.engine import DTYPES
from llmserve.config.model import ModelConfig
from llmserve.engine.engine import free_memory_bytes, resolve_device, resolve_dtype
from llmserve.entrypoints.cli.output import format_bytes
from llmserve.layers.attention.selector import reads_only_written_slots
from llmserve.layers.kv_cache import resolve_kv_cache_dtype
from llmserve.loader.catalog import ModelSource, resolve_model
from llmserve.loader.model_loader import read_model_config
from llmserve.memory import (
    DTYPE_BYTES,
    kquant_weight_bytes,
    kv_bytes_per_token,
    parameter_counts,
    parse_size,
    plan_kv_cache,
    quantized_weight_bytes,
    rank_config,
    vision_parameter_count,
    weight_bytes,
)

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "int8": torch.int8}


def memory_report(
    model: str,
    batch: int,
    seq_len: int | None,
    dtype: str,
    kv_dtype: str | None,
    kv_cache_memory: str | float,
    block_size: int,
    device: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    link: tuple[float, float] | None = None,
    read_bandwidth: float | None = None,
    tensor_across_hosts: bool = False,
) -> str:
    """The lines `llmserve memory` prints; with `tensor_parallel_size` > 1, also what each
    rank holds (its share of heads, channels and vocabulary) and how many tokens the
    per-rank KV budget then holds; with `pipeline_parallel_size` > 1 each stage's layers,
    weights and KV; with `link` (bytes/s, one-way latency in seconds: a link between
    hosts, one pipeline stage on each) the bytes each link carries and a decode step's
    expected time, its weights read at `read_bandwidth` (bytes/s; None: measured now)."""
    if batch < 1 or (seq_len is not None and seq_len < 1):
        raise ValueError("--batch and --seq-len must be at least 1")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch_device = resolve_device(device)
    weight_dtype = resolve_dtype(dtype, torch_device)
    source = resolve_model(model)
    method = _weight_method(source, dtype, quantization, torch_device)
    auto_kv = resolve_kv_cache_dtype("auto", weight_dtype, method,
                                     reads_only_written_slots(torch_device))
    kv_torch_dtype = _kv_dtype(kv_dtype, auto_kv)
    cfg = read_model_config(source)
    seq_len = seq_len or cfg.max_position_embeddings
    budget = (int(kv_cache_memory * free_memory_bytes(torch_device))
              if isinstance(kv_cache_memory, float) else parse_size(kv_cache_memory))
    plan = plan_kv_cache(cfg, kv_torch_dtype, budget, block_size)
    per_token = kv_bytes_per_token(cfg, kv_torch_dtype)
    elem = DTYPE_BYTES[kv_torch_dtype]
    wbytes = weight_bytes(cfg, weight_dtype)
    num_params = wbytes // DTYPE_BYTES[weight_dtype]
    weights_line = (f"{num_params:,} parameters x {DTYPE_BYTES[weight_dtype]} bytes "
                    f"({_name(weight_dtype)}) = {format_bytes(wbytes)}")
    if method:
        layout = {"int8": "int8 (packed, with per-channel scales",
                  "int4": "int4 linears (groups of 32 with fp16 scales and offsets; an int8 "
                          "head",
                  "int4-a8": "int4-a8 linears (int4 groups of 32 with fp16 scales and "
                             "offsets, 8-bit activations; an int8 head",
                  "kquant": "the file's own blocks (K-quants, legacy types, IQ4_XS; "
                            "other matrices at int8"}[method]
        wbytes_q = (kquant_weight_bytes(cfg, _tensor_types(source)) if method == "kquant"
                    else quantized_weight_bytes(cfg, method))
        weights_line = (f"{num_params:,} parameters as {layout}; fp32 norms and rotary "
                        f"tables) = {format_bytes(wbytes_q)}")
    tokens = batch * seq_len
    fits = plan.num_tokens // seq_len
    lines = [
        f"model         {source.name} ({cfg.architecture}, {source.kind}: {source.path})",
        f"shape         {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, "
        f"head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size}, "
        f"vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}",
        f"weights       {weights_line}",
        f"KV per token  2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} "
        f"kv_heads x {_kv_entry(cfg.head_dim, elem, kv_torch_dtype)} "
        f"= {per_token:,} bytes",
        f"KV for batch  {batch} x {seq_len} tokens = {tokens:,} tokens x {per_token:,} bytes "
        f"= {format_bytes(tokens * per_token)}",
        f"KV budget     {format_bytes(budget)}: {plan.num_blocks:,} blocks of {block_size} tokens "
        f"= {plan.num_tokens:,} tokens ({format_bytes(plan.total_bytes)})",
        f"fits          {'yes' if tokens <= plan.num_tokens else 'no'}: the budget holds "
        f"{fits:,} sequence(s) of {seq_len} tokens; batch {batch} needs {tokens:,} tokens",
    ]
    if cfg.moe is not None:
        total, active = parameter_counts(cfg)
        moe = cfg.moe
        sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        shared = (f" + a shared expert of {moe.shared_intermediate_size}"
                  if moe.shared_intermediate_size else "")
        lines.insert(2, f"experts       {sparse} of {cfg.num_hidden_layers} layers: "
                        f"{moe.top_k} of {moe.num_experts} experts of intermediate "
                        f"{moe.intermediate_size} a token{shared}; {active:,} of {total:,} "
                        f"parameters active a token ({100 * active / total:.1f} %)")
    if cfg.vision is not None:
        vision = cfg.vision
        lines.insert(2, f"images        a {vision.tower.upper()} tower of "
                        f"{vision.num_hidden_layers} layers x {vision.hidden_size} and the "
                        f"projector: {vision_parameter_count(cfg):,} parameters (float, in "
                        f"the weights); {_image_tokens(vision)} of the context and KV")
    if tensor_parallel_size > 1:
        lines += _rank_lines(cfg, tensor_parallel_size, weight_dtype, method, kv_torch_dtype,
                             budget, block_size)
    if pipeline_parallel_size > 1 or link is not None:
        total_bytes = (wbytes_q if method else wbytes)
        lines += _pipeline_lines(cfg, total_bytes, tensor_parallel_size,
                                 pipeline_parallel_size, per_token, link, read_bandwidth,
                                 tensor_across_hosts)
    if seq_len > cfg.max_position_embeddings:
        lines.append(f"warning       --seq-len {seq_len} exceeds the model's context of "
                     f"{cfg.max_position_embeddings} tokens")
    return "\n".join(lines)


def _rank_lines(cfg: ModelConfig, size: int, weight_dtype: torch.dtype, method: str | None,
                kv_dtype: torch.dtype, budget: int, block_size: int) -> list[str]:
    lines = []
    for rank in range(size):
        share = rank_config(cfg, size, rank)
        wbytes = (quantized_weight_bytes(share, method) if method
                  else weight_bytes(share, weight_dtype))
        plan = plan_kv_cache(share, kv_dtype, budget, block_size)
        lines.append(
            f"rank {rank}/{size:<4}  {share.num_attention_heads} heads / "
            f"{share.num_key_value_heads} KV heads, intermediate {share.intermediate_size}, "
            f"vocab {share.vocab_size}: weights {format_bytes(wbytes)}, KV "
            f"{kv_bytes_per_token(share, kv_dtype):,} bytes/token, budget holds "
            f"{plan.num_tokens:,} tokens")
    return lines


def _pipeline_lines(cfg: ModelConfig, weight_total: int, tp: int, pp: int, kv_per_token: int,
                    link: tuple[float, float] | None, read_bandwidth: float | None,
                    tensor_across_hosts: bool) -> list[str]:
    """Each stage's share, and with a link what it carries and a decode step's plan."""
    from llmserve.distributed.pipeline import plan_step

    if read_bandwidth is None and link is not None:
        from llmserve.bench.kernels import measure_read_bandwidth

        read_bandwidth = measure_read_bandwidth()
    rate, latency = link if link is not None else (1.0, 0.0)
    plan = plan_step(cfg, weight_total, pp, tp, read_bandwidth or 1.0, rate, latency,
                     tensor_across_hosts)
    per_layer_kv = kv_per_token // cfg.num_hidden_layers
    lines = []
    for s, (layers, wbytes) in enumerate(zip(plan.stages, plan.stage_weight_bytes,
                                             strict=True)):
        extra = " + the embedding and LM head" if s == 0 else ""
        lines.append(f"stage {s}/{pp:<3}  layers {layers.start}-{layers.stop - 1}{extra}: "
                     f"weights {format_bytes(wbytes)} (over {tp} rank(s)), KV "
                     f"{per_layer_kv * len(layers):,} bytes/token")
    if link is None:
        return lines
    lines += [
        f"link          {rate * 8 / 1e9:g} Gbit/s, {latency * 1e3:g} ms one way: a decode step "
        f"crosses it {plan.link_hops} time(s) (stage to stage, then back to stage 0), "
        f"{plan.link_bytes_per_token:,} bytes a token in flight each"
        + (f"; tensor parallelism across hosts adds {2 * cfg.num_hidden_layers + 2} "
           "exchanges a step" if tensor_across_hosts and tp > 1 else ""),
        f"step plan     one stream: weights read {1e3 * plan.compute_s:.1f} ms (at "
        f"{read_bandwidth / 1e9:.1f} GB/s) + links {1e3 * plan.link_s:.1f} ms = "
        f"{1e3 * plan.step_s:.1f} ms a token ({1 / plan.step_s:.1f} tok/s); under load "
        f"every stage works on its own batch",
    ]
    return lines


def _kv_entry(head_dim: int, elem: int, dtype: torch.dtype) -> str:
    entry = f"{head_dim} head_dim x {elem} bytes ({_name(dtype)})"
    return f"({entry} + a 4-byte scale)" if dtype == torch.int8 else entry


def _tensor_types(source: ModelSource) -> dict:
    """A GGUF file's tensor types by name (its header only)."""
    from llmserve.gguf_meta import open_gguf

    return {t.name: t.tensor_type for t in open_gguf(source.path).tensors}


def _weight_method(source: ModelSource, dtype: str, quantization: str | None,
                   device: torch.device) -> str | None:
    """The quantized method the engine would run this model on ("int8", "int4", "int4-a8"),
    or None for float weights: as `load_model` decides."""
    from llmserve.config.engine import EngineConfig
    from llmserve.loader.model_loader import auto_quantization

    wanted = EngineConfig(dtype=dtype, quantization=quantization).weight_quantization
    if wanted != "auto":
        return wanted
    if source.kind != "gguf":
        return None
    from llmserve.loader.gguf import gguf_stored_quantization

    return auto_quantization(gguf_stored_quantization(source.path), device,
                             read_model_config(source))


def _kv_dtype(name: str | None, weight_dtype: torch.dtype) -> torch.dtype:
    if name is None:
        return weight_dtype
    canonical = "int8" if name == "int8" else DTYPES.get(name)
    if canonical not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {name!r}")
    return KV_DTYPES[canonical]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _image_tokens(vision) -> str:
    """What an image costs in the context: its tokens, or a tiled model's per tile."""
    if vision.tiled:  # Idefics3 / SmolVLM: 1 tile for a small image, rows x cols + 1 else
        return (f"each image takes {vision.tokens_per_image} tokens a tile (a tile of "
                f"{vision.image_size} px; an image is cut into up to rows x columns of them "
                f"plus the whole)")
    if vision.merged:  # Qwen2.5-VL: by the image's size as its processor resizes it
        side = vision.merged_patch
        return (f"each image takes one token per {side} x {side} px as resized (up to "
                f"{vision.tokens_per_image} under the processor's default pixel cap)")
    return f"each image takes {vision.tokens_per_image} tokens"
