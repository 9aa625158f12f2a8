"""Load a GGUF file into dense torch weights under Hugging Face Llama names.

The config comes from the GGUF metadata, tensor names are remapped by the declared tables
below, quantized tensors are dequantized with the torch kernels in `gguf_dequant.py`
(bit-identical ports of `gguf.quants`, several times faster), and llama.cpp's rotary row
permutation of Q/K is undone for the archs whose converter applies it.
"""

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from llmserve.config.model import ModelConfig, MoEConfig
from llmserve.errors import ModelFormatError, UnsupportedModelError
from llmserve.gguf_meta import GGUFTensor, open_gguf, read_metadata
from llmserve.loader.gguf_dequant import DEQUANTIZERS
from llmserve.loader.weights import (
    LoadedWeights,
    WeightSlices,
    check_weight_shapes,
    drop_tied_head,
    not_held,
    require_path,
)
from llmserve.quantization.kquant import KQUANT_TYPES, LEGACY_TYPES, SUPER, RawBlocks

# GGUF `general.architecture` -> Hugging Face `model_type` (a "llama" file with experts is
# Mixtral's: `MIXTRAL`).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
                      "gemma2": "gemma2", "phi3": "phi3",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                      # Qwen2.5-VL's and Qwen3-VL's decoders: Qwen2 / Qwen3 with M-RoPE
                      "qwen2vl": "qwen2", "qwen3vl": "qwen3"}
MIXTRAL = "mixtral"
# llama.cpp's mixtures renormalise the chosen experts' weights as each family does, fixed
# per architecture (its `build_moe_ffn(..., norm_w)`), unless `{arch}.expert_weights_norm`
# says otherwise
EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
# a mixture's experts: one 3-D tensor (experts, rows, columns) per projection ->
# `model.layers.{i}.mlp.experts.{e}.<projection>`
EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj.weight",
                  "ffn_up_exps.weight": "up_proj.weight",
                  "ffn_down_exps.weight": "down_proj.weight"}
ROUTER = "ffn_gate_inp.weight"
SHARED_EXPERT_GATE = "ffn_gate_inp_shexp.weight"  # (hidden,) in GGUF, (1, hidden) in HF

FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16})
# 4-bit types whose blocks are groups of 32 with a scale and an offset: the int4 kernels
# run them as stored (a Q4_0 or Q4_1 file; K-quant files run on their own kernels)
FOUR_BIT_TYPES = frozenset({QT.Q4_0, QT.Q4_1})

# llama.cpp's convert script permutes Q/K rows (interleaved -> half-split rotary) for these.
ROTARY_PERMUTED_ARCHITECTURES = frozenset({"llama"})

GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# `blk.{i}.<key>` -> `model.layers.{i}.<value>`
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    ROUTER: "mlp.gate.weight",
    SHARED_EXPERT_GATE: "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma 3 norms around both halves of a layer: its `ffn_norm` is the pre-MLP norm.
GEMMA3_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 keeps its fused projections: `attn_qkv` (q | k | v rows), `ffn_up` (gate | up rows)
PHI3_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
LAYER_NAMES = {"gemma3": GEMMA3_LAYER_NAMES, "gemma2": GEMMA3_LAYER_NAMES,
               "phi3": PHI3_LAYER_NAMES}
# Phi-3's LongRoPE factors, one per frequency (llama.cpp's names)
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")

# Gemma's RMSNorm scales by (1 + weight); llama.cpp's converter stores 1 + weight, the
# Hugging Face checkpoint (our canonical form) the weight itself.
NORM_SHIFTED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
# Gemma 3 in llama.cpp: five local layers (window, rotary base 10000) to one global
GEMMA3_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0

# Llama 3 GGUFs carry their rope scaling as per-frequency divisors, not as metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              slices: WeightSlices | None = None,
              on_blocks: Callable[[dict[str, RawBlocks]], set[str]] | None = None
              ) -> LoadedWeights:
    """Load a GGUF model file: config from its metadata, weights dequantized to `dtype`.

    `slices(config, name)` -> (rows, columns) of each tensor to read (a tensor-parallel
    rank's share, `distributed/parallel.py`): only those bytes of the file are read and
    dequantized.

    Matrices of the types the kernels run on their own blocks (KQUANT_TYPES) are kept as
    blocks too (`LoadedWeights.blocks`, views of the file; a mixture's experts each its
    own, but under tensor parallelism). `on_blocks(blocks)` names those
    that will run on their blocks alone: they are not dequantized at all (an 8B Q4_K_M
    file would take 32 GB as float32).

    Raises ModelNotFoundError (no such file), ModelFormatError (truncated or corrupt) or
    UnsupportedModelError (architecture or tensor type llmserve cannot run).
    """
    path = require_path(path, is_dir=False)
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    arch = _architecture(metadata)
    by_name = {t.name: t for t in reader.tensors}
    config = _checked_config(path, metadata, arch, by_name)
    for name in (ROPE_FREQS_TENSOR, *ROPE_FACTORS):
        by_name.pop(name, None)
    blocks: dict[str, RawBlocks] = {}
    for name, tensor in by_name.items():
        if _is_experts(name):
            if slices is None:  # (under tensor parallelism a rank's experts are dequantized)
                blocks |= _expert_blocks(name, tensor)
            continue
        canonical = hf_name(name, arch)
        rows, cols = slices(config, canonical) if slices is not None else (None, None)
        if not_held(rows):
            continue  # another pipeline stage's
        raw = _raw_blocks(tensor, rows, cols)
        if raw is not None and arch in ROTARY_PERMUTED_ARCHITECTURES and _is_qk(name):
            raw = raw.take_rows(_unpermute_qk(name, torch.arange(raw.rows), config).numpy())
        if raw is not None:
            blocks[canonical] = raw
    if config.tie_word_embeddings:
        blocks.pop("lm_head.weight", None)
    blocks_only = on_blocks(blocks) if on_blocks is not None else set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in by_name.items():
        if _is_experts(name):
            for canonical, weight in _experts_to_torch(name, tensor, config, slices,
                                                       blocks_only):
                tensors[canonical] = weight.to(dtype)
            continue
        canonical = hf_name(name, arch)
        if canonical in blocks_only:
            continue
        rows, cols = slices(config, canonical) if slices is not None else (None, None)
        if not_held(rows):
            continue
        weight = tensor_to_torch(tensor, rows, cols)
        if arch in ROTARY_PERMUTED_ARCHITECTURES:
            weight = _unpermute_qk(name, weight, config)
        if arch in NORM_SHIFTED_ARCHITECTURES and name.endswith("norm.weight"):
            weight = weight.float() - 1.0
        if name.endswith(SHARED_EXPERT_GATE):
            weight = weight.reshape(1, -1)
        tensors[canonical] = weight.to(dtype)
    drop_tied_head(config, tensors)
    return LoadedWeights(config=config, tensors=tensors, metadata=metadata,
                         quantization=stored_quantization(by_name.values()), blocks=blocks,
                         blocks_only=blocks_only)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file, without reading or dequantizing its weights."""
    path = require_path(path, is_dir=False)
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    return _checked_config(path, metadata, _architecture(metadata), by_name)


def _checked_config(path: Path, metadata: dict[str, Any], arch: str,
                    tensors: dict[str, GGUFTensor]) -> ModelConfig:
    """The config of a GGUF file, its values and every tensor's type and shape checked
    against it before a byte of weights is read."""
    tensors = dict(tensors)
    rope_freqs = tensors.pop(ROPE_FREQS_TENSOR, None)
    factors = [tensors.pop(name, None) for name in ROPE_FACTORS]
    for tensor in [*tensors.values(), *(t for t in (rope_freqs, *factors) if t)]:
        _check_supported(tensor)
    try:
        config = _build_config(metadata, arch, tensors, rope_freqs, factors)
    except ValueError as e:  # ModelConfig's checks of the values
        raise ModelFormatError(f"{path}: {e}") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape))
        if _is_experts(name):
            if len(shape) != 3:
                raise ModelFormatError(f"{path}: tensor {name} has shape {shape}, not "
                                       f"(experts, rows, columns)")
            shapes |= {canonical: shape[1:] for canonical in _expert_names(name, shape[0])}
        else:
            shapes[hf_name(name, arch)] = (1, *shape) if name.endswith(SHARED_EXPERT_GATE) \
                else shape
    check_weight_shapes(config, shapes, path)
    return config


def _is_experts(gguf_name: str) -> bool:
    return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[-1] in EXPERT_TENSORS


def _expert_names(gguf_name: str, num_experts: int) -> list[str]:
    """The canonical names of a 3-D expert tensor's experts, in order."""
    _, layer, key = gguf_name.split(".", 2)
    return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_TENSORS[key]}"
            for e in range(num_experts)]


def _experts_to_torch(name: str, tensor: GGUFTensor, config: ModelConfig,
                      slices: WeightSlices | None, skip: set[str] = frozenset()
                      ) -> list[tuple[str, torch.Tensor]]:
    """Each expert of a 3-D tensor dequantized (experts are its outermost dimension, so each
    is a contiguous run of whole rows), but those named in `skip` (they run on their
    blocks alone); under tensor parallelism only this rank's experts are read."""
    num_experts, rows, cols = (int(d) for d in reversed(tensor.shape))
    per_expert = tensor.data.view(np.uint8).reshape(num_experts, -1)
    out = []
    for e, canonical in enumerate(_expert_names(name, num_experts)):
        held, _ = slices(config, canonical) if slices is not None else (None, None)
        if held is not None or canonical in skip:  # another rank's, or on its blocks
            continue
        raw = torch.from_numpy(np.array(per_expert[e]))  # a copy out of the memmap
        out.append((canonical, DEQUANTIZERS[tensor.tensor_type](raw).reshape(rows, cols)))
    return out


def stored_quantization(tensors) -> str | None:
    """The kernels that keep a file's quantization: "kquant" (the file's own blocks,
    quantization/kquant.py) when any layer's linear weight is a K-quant type (Q4_K, Q5_K,
    Q6_K; the rest of the file runs on its blocks too where they are whole 256-value runs,
    else at int8), or when every one is a 2-D matrix of a legacy type (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0; a mixture's 3-D experts among them) over a multiple of 256 columns;
    otherwise "int4" when every one is Q4_0 or Q4_1 (rows of 576 values), "int8" for other
    quantized files, None for float files."""
    tensors = list(tensors)
    if all(t.tensor_type in FLOAT_TYPES for t in tensors):
        return None
    # the layers' linears (a mixture's 3-D experts among them; its router is not one)
    linears = [t for t in tensors if t.name.startswith("blk.") and len(t.shape) in (2, 3)
               and not t.name.endswith((ROUTER, SHARED_EXPERT_GATE))]
    if any(t.tensor_type in KQUANT_TYPES and t.tensor_type not in LEGACY_TYPES
           for t in linears):
        return "kquant"
    if linears and all(t.tensor_type in LEGACY_TYPES and int(t.shape[0]) % SUPER == 0
                       for t in linears):
        return "kquant"
    if linears and all(t.tensor_type in FOUR_BIT_TYPES for t in linears):
        return "int4"
    return "int8"


def gguf_stored_quantization(path: str | Path) -> str | None:
    """`stored_quantization` of a GGUF file (reads only its header)."""
    return stored_quantization(open_gguf(require_path(path, is_dir=False)).tensors)


def gguf_file_type(path: str | Path) -> str:
    """The type a GGUF file says it was quantized to (`general.file_type`: Q4_K_M, Q8_0,
    F16...); where it says none, the type of most of its matrices' bytes."""
    from gguf import LlamaFileType

    file = open_gguf(require_path(path, is_dir=False))
    value = file.metadata.get("general.file_type")
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, TypeError):
        size: dict[str, int] = {}
        for t in file.tensors:
            size[t.tensor_type.name] = size.get(t.tensor_type.name, 0) + t.data.nbytes
        return max(size, key=size.get) if size else "unknown"


def gguf_main_block_type(path: str | Path) -> str:
    """The GGUF type of most of a file's matrices on their own blocks (`main_block_type`
    of what `load_gguf` keeps as blocks), from its header alone."""
    size: dict[str, int] = {}
    for t in open_gguf(require_path(path, is_dir=False)).tensors:
        if t.tensor_type in KQUANT_TYPES and len(t.shape) in (2, 3):
            size[t.tensor_type.name] = size.get(t.tensor_type.name, 0) + t.data.nbytes
    return max(size, key=size.get) if size else "Q4_K"


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, key = rest.partition(".")
    names = LAYER_NAMES.get(arch, GGUF_LAYER_NAMES)
    if prefix == "blk" and layer.isdigit() and key in names:
        return f"model.layers.{layer}.{names[key]}"
    raise UnsupportedModelError(f"unsupported GGUF tensor {gguf_name!r}")


def _architecture(metadata: dict[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    return arch


def _check_supported(tensor: GGUFTensor) -> None:
    if tensor.tensor_type not in DEQUANTIZERS:
        raise UnsupportedModelError(
            f"unsupported GGUF tensor type {tensor.tensor_type.name} in {tensor.name} "
            f"(supported: {', '.join(t.name for t in DEQUANTIZERS)})"
        )


def _build_config(
    metadata: dict[str, Any],
    arch: str,
    tensors: dict[str, GGUFTensor],
    rope_freqs: GGUFTensor | None,
    rope_factors: list[GGUFTensor | None] | None = None,
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; bias, qk-norm and tying from which tensors exist.
    A missing or ill-typed value is a ValueError naming its key."""

    def size(name: str, default: int | None = None, minimum: int = 1) -> int:
        return _metadata_int(metadata, f"{arch}.{name}", default, minimum)

    def number(name: str, default: float) -> float:
        return _metadata_float(metadata, f"{arch}.{name}", default)

    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelFormatError("GGUF file has no token_embd.weight tensor")
    if len(embedding.shape) != 2:
        raise ValueError(f"token_embd.weight has shape {embedding.shape}, not (hidden, vocab)")
    hidden, heads = size("embedding_length"), size("attention.head_count")
    head_dim = size("attention.key_length", 0, minimum=0) or size(
        "rope.dimension_count", hidden // heads, minimum=0)
    rope_theta = number("rope.freq_base", 10000.0)
    num_layers = size("block_count")
    if num_layers > len(tensors):  # before anything is built per layer
        raise ValueError(f"GGUF metadata '{arch}.block_count' is {num_layers}, but the file "
                         f"holds {len(tensors)} tensors")
    gemma = arch in ("gemma2", "gemma3")
    window = size("attention.sliding_window", 0, minimum=0)
    windows: tuple[int, ...] = ()
    if window and gemma:  # Gemma 2: every other layer local, from the first
        pattern = GEMMA3_WINDOW_PATTERN if arch == "gemma3" else 2
        windows = tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    elif window:  # Mistral-style: every layer windowed
        windows = (window,) * num_layers
    moe = _moe_config(metadata, arch, tensors, num_layers)
    return ModelConfig(
        architecture=MIXTRAL if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
        # The embedding's row count, which can exceed the tokenizer's token list (padding).
        vocab_size=int(embedding.shape[1]),
        hidden_size=hidden,
        intermediate_size=size("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=size("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=size("context_length"),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=_longrope(metadata, arch, rope_factors or [])
        or _rope_scaling(metadata, arch, rope_freqs, head_dim, rope_theta),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        sliding_windows=windows,
        rope_local_theta=(GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else rope_theta)
        if gemma else None,
        # llama.cpp: 1/sqrt(head_dim) for Gemma 2 and 3, except their 27Bs' (46 and 62
        # layers) 1/sqrt(hidden / heads)
        attention_scale=(hidden / heads) ** -0.5
        if gemma and num_layers == {"gemma2": 46, "gemma3": 62}[arch] else None,
        attn_logit_softcapping=number("attn_logit_softcapping", 0.0) or None,
        final_logit_softcapping=number("final_logit_softcapping", 0.0) or None,
        qk_norm_across_heads=arch == "olmoe",
        moe=moe,
        mrope_section=_mrope_section(metadata, arch),
        mrope_interleaved=arch == "qwen3vl",  # llama.cpp's "imrope"
        # Qwen3-VL: the layers an image token's DeepStack rows are added after (the
        # projector file's rows must match)
        extra={"deepstack_layers": size("n_deepstack_layers", 0, minimum=0)}
        if arch == "qwen3vl" else {},
    )


def _mrope_section(metadata: dict[str, Any], arch: str) -> tuple[int, ...] | None:
    """Qwen2.5-VL's and Qwen3-VL's M-RoPE sections (`{arch}.rope.dimension_sections`:
    temporal, row, column and a fourth, unused, 0)."""
    if arch not in ("qwen2vl", "qwen3vl"):
        return None
    key = f"{arch}.rope.dimension_sections"
    sections = metadata.get(key)
    if not isinstance(sections, list | tuple) or len(sections) < 3 or any(
            not isinstance(n, int) for n in sections):
        raise ValueError(f"GGUF metadata '{key}' must list M-RoPE's sections, got "
                         f"{sections!r}")
    if any(sections[3:]):
        raise UnsupportedModelError(f"{key} {list(sections)}: a fourth M-RoPE section is "
                                    f"not supported")
    return tuple(sections[:3])


def _moe_config(metadata: dict[str, Any], arch: str, tensors: dict[str, GGUFTensor],
                num_layers: int) -> MoEConfig | None:
    """A mixture's shape from `{arch}.expert_*` metadata (None without experts); its sparse
    layers are those with a router tensor, as llama.cpp reads them."""
    experts = _metadata_int(metadata, f"{arch}.expert_count", 0, minimum=0)
    if not experts:
        return None
    ffn = _metadata_int(metadata, f"{arch}.feed_forward_length")
    width = _metadata_int(metadata, f"{arch}.expert_feed_forward_length", 0, minimum=0) or ffn
    sparse = [i for i in range(num_layers) if f"blk.{i}.{ROUTER}" in tensors]
    shared = 0
    if sparse and f"blk.{sparse[0]}.ffn_gate_shexp.weight" in tensors:
        shared = _metadata_int(metadata, f"{arch}.expert_shared_feed_forward_length", 0,
                               minimum=0) or ffn
    norm = metadata.get(f"{arch}.expert_weights_norm", EXPERT_WEIGHTS_NORM.get(arch, False))
    if not isinstance(norm, bool):
        raise ValueError(f"GGUF metadata '{arch}.expert_weights_norm' must be true or false, "
                         f"got {norm!r}")
    return MoEConfig(num_experts=experts,
                     top_k=_metadata_int(metadata, f"{arch}.expert_used_count"),
                     intermediate_size=width, norm_topk_prob=norm,
                     shared_intermediate_size=shared,
                     dense_layers=tuple(i for i in range(num_layers) if i not in sparse))


def _longrope(metadata: dict[str, Any], arch: str, factors: list[GGUFTensor | None]
              ) -> dict[str, Any] | None:
    """Phi-3's LongRoPE from its `rope_factors_{short,long}` tensors and
    `{arch}.rope.scaling.*` keys (None without factor tensors)."""
    short, long = factors if len(factors) == 2 else (None, None)
    if short is None and long is None:
        return None
    if short is None or long is None:
        raise ValueError("GGUF file has one of rope_factors_short / rope_factors_long only")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": tensor_to_torch(short).float().flatten().tolist(),
        "long_factor": tensor_to_torch(long).float().flatten().tolist(),
        "original_max_position_embeddings": _metadata_int(
            metadata, f"{arch}.rope.scaling.original_context_length"),
        "max_position_embeddings": _metadata_int(metadata, f"{arch}.context_length"),
    }
    if f"{arch}.rope.scaling.attn_factor" in metadata:
        scaling["attention_factor"] = _metadata_float(
            metadata, f"{arch}.rope.scaling.attn_factor", 1.0)
    return scaling


def _metadata_int(metadata: dict[str, Any], key: str, default: int | None = None,
                  minimum: int = 1) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks '{key}'")
    if type(value) is not int or value < minimum:  # bool is not an int here
        raise ValueError(f"GGUF metadata '{key}' must be an integer >= {minimum}, "
                         f"got {value!r}")
    return value


def _metadata_float(metadata: dict[str, Any], key: str, default: float) -> float:
    value = metadata.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"GGUF metadata '{key}' must be a number, got {value!r}")
    return float(value)


def _rope_scaling(
    metadata: dict[str, Any],
    arch: str,
    rope_freqs: GGUFTensor | None,
    head_dim: int,
    rope_theta: float,
) -> dict[str, Any] | None:
    """HF-style `rope_scaling` from `{arch}.rope.scaling.*` keys or a `rope_freqs` tensor."""
    if rope_freqs is not None:
        divisors = tensor_to_torch(rope_freqs).float().flatten()
        return _llama3_scaling_from_divisors(divisors, head_dim, rope_theta)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if f"{arch}.rope.scaling.factor" in metadata:
        scaling["factor"] = _metadata_float(metadata, f"{arch}.rope.scaling.factor", 0.0)
    if (original := f"{arch}.rope.scaling.original_context_length") in metadata:
        scaling["original_max_position_embeddings"] = _metadata_int(metadata, original)
    return scaling


def _llama3_scaling_from_divisors(
    divisors: torch.Tensor, head_dim: int, rope_theta: float
) -> dict[str, Any]:
    """Recover Llama 3 rope_scaling from llama.cpp's per-frequency divisors.

    llama.cpp stores only the result of the Llama 3 formula; every Llama 3.x release uses the
    same low/high factors and original context, so the factor (the largest divisor) fixes the
    rest. The recovered parameters are checked by recomputing the divisors.
    """
    if divisors.numel() == 0 or 2 * divisors.numel() != head_dim:
        raise UnsupportedModelError(f"unsupported GGUF rope_freqs of {divisors.numel()} values "
                                    f"(not Llama 3 rope scaling of head_dim {head_dim})")
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **LLAMA3_ROPE_DEFAULTS}
    inv_freq = rope_theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    expected = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    expected = torch.where(wavelen < original / high, 1.0, expected)
    expected = torch.where(wavelen > original / low, scaling["factor"], expected)
    if not torch.allclose(divisors.double(), expected, rtol=1e-4):
        raise UnsupportedModelError("unsupported GGUF rope_freqs (not Llama 3 rope scaling)")
    return scaling


def tensor_to_torch(tensor: GGUFTensor, rows: slice | None = None, cols: slice | None = None
              ) -> torch.Tensor:
    """The tensor dequantized to float32 (F16/BF16 kept as is), in torch (out, in) order;
    with `rows`/`cols`, only that part (whole quantization blocks are read from the file,
    so a column range on block boundaries reads only its own bytes)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    data = tensor.data.reshape(-1)
    if rows is None and cols is None:
        raw = np.array(data).view(np.uint8)  # copy out of the read-only memmap
        return DEQUANTIZERS[tensor.tensor_type](torch.from_numpy(raw)).reshape(shape)
    num_rows = shape[0] if len(shape) > 1 else 1
    if len(shape) == 1:  # a vector: its one dimension is the "rows" of the slice
        rows, cols = None, rows
    picked, width, cols = _block_rows(tensor, num_rows, shape[-1], rows, cols)
    raw = torch.from_numpy(np.array(picked).reshape(-1))  # a copy: the memmap is read-only
    values = DEQUANTIZERS[tensor.tensor_type](raw).reshape(len(picked), width)
    if cols is not None:
        values = values[:, cols]
    return values.reshape(-1) if len(shape) == 1 else values


def _block_rows(tensor: GGUFTensor, num_rows: int, width: int, rows: slice | None,
                cols: slice | None) -> tuple[np.ndarray, int, slice | None]:
    """The stored bytes (rows, bytes per row) of `rows` and, where `cols` lies on block
    boundaries, of those columns alone: (bytes, their width in values, the column slice
    still to take from the dequantized values, or None)."""
    by_row = tensor.data.view(np.uint8).reshape(num_rows, -1)
    picked = by_row[rows if rows is not None else slice(None)]
    if cols is None:
        return picked, width, None
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    col_range = range(width)[cols]
    if col_range.start % block_values or len(col_range) % block_values:
        return picked, width, cols
    first = col_range.start // block_values * block_bytes
    picked = picked[:, first: first + len(col_range) // block_values * block_bytes]
    return picked, len(col_range), None


def _expert_blocks(name: str, tensor: GGUFTensor) -> dict[str, RawBlocks]:
    """Each expert of a 3-D tensor of a type the kernels run on its own blocks, as its
    blocks (views of the file: an expert is a contiguous run of whole rows); {} for other
    types."""
    if tensor.tensor_type not in KQUANT_TYPES:
        return {}
    num_experts, rows, cols = (int(d) for d in reversed(tensor.shape))
    per_expert = tensor.data.view(np.uint8).reshape(num_experts, rows, -1)
    return {canonical: RawBlocks(tensor.tensor_type, per_expert[e], cols)
            for e, canonical in enumerate(_expert_names(name, num_experts))}


def _raw_blocks(tensor: GGUFTensor, rows: slice | None, cols: slice | None
                ) -> RawBlocks | None:
    """A matrix's blocks as stored (the part `rows`, `cols` of it), for the kernels on a
    file's own blocks (KQUANT_TYPES); None for other types, or a column range off the
    blocks."""
    if tensor.tensor_type not in KQUANT_TYPES or len(tensor.shape) != 2:
        return None
    width, num_rows = (int(d) for d in tensor.shape)
    picked, width, cols_left = _block_rows(tensor, num_rows, width, rows, cols)
    return None if cols_left is not None else RawBlocks(tensor.tensor_type, picked, width)


def _is_qk(name: str) -> bool:
    """Whether GGUF tensor `name` is a Q or K projection (rows permuted by llama.cpp)."""
    return ".attn_q." in name or ".attn_k." in name


def _unpermute_qk(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (d/2, 2) -> (2, d/2)."""
    if not _is_qk(name):
        return weight
    num_heads = weight.shape[0] // config.head_dim  # a rank's share holds whole heads
    half = weight.shape[0] // num_heads // 2
    # (heads, half, 2, ...) -> (heads, 2, half, ...)
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
    return rows.reshape(weight.shape)
