"""Memory arithmetic shared by `llmserve memory` and the engine's KV-cache sizing."""

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.config.model import ModelConfig

# A bare letter (2G) means the binary unit, as llama.cpp and most users mean it.
_UNITS = {
    "": 1, "B": 1,
    "K": 2**10, "KIB": 2**10, "KB": 10**3,
    "M": 2**20, "MIB": 2**20, "MB": 10**6,
    "G": 2**30, "GIB": 2**30, "GB": 10**9,
    "T": 2**40, "TIB": 2**40, "TB": 10**12,
}

DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int8: 1}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5 GiB' or a plain byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 2GiB, 512MiB or 1073741824")
    return int(float(match.group(1)) * _UNITS[unit])


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None = None
                       ) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x bytes per element [+ an fp32 scale]).

    An int8 cache keeps one fp32 scale per token and KV head, beside the int8 entries.
    `num_kv_heads`: the heads one tensor-parallel rank holds (default: all).
    """
    per_head = cfg.head_dim * DTYPE_BYTES[dtype] + (4 if dtype == torch.int8 else 0)
    heads = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    return 2 * cfg.num_hidden_layers * heads * per_head


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active): the model's parameters, and those one token reads (a mixture of
    experts' token runs its top_k experts of all; a dense model's active are its total)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    if cfg.attention_bias:
        attn += d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    sandwich = cfg.architecture in ("gemma2", "gemma3")  # norms after the sublayers too
    norms = (4 if sandwich else 2) * h + (_qk_norm_size(cfg) if cfg.qk_norm else 0)
    total = active = cfg.num_hidden_layers * (attn + norms)
    moe = cfg.moe
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            total, active = total + 3 * h * i, active + 3 * h * i
            continue
        shared = 3 * h * moe.shared_intermediate_size + h if moe.shared_intermediate_size else 0
        expert = 3 * h * moe.intermediate_size
        total += moe.num_experts * h + moe.num_experts * expert + shared
        active += moe.num_experts * h + moe.top_k * expert + shared
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    # a vision tower is read once per image, not per token: in the total only
    return total + embed + h + vision_parameter_count(cfg), active + embed + h


def vision_parameter_count(cfg: ModelConfig) -> int:
    """A vision-language model's tower and projector parameters (0 for a text model); they
    stay float in every format."""
    vision = cfg.vision
    if vision is None:
        return 0
    v, f, t = vision.hidden_size, vision.intermediate_size, cfg.hidden_size
    if vision.merged:
        patch = vision.num_channels * vision.temporal_patch_size * vision.patch_size ** 2 * v
        wide = v * vision.spatial_merge_size ** 2
        mlp = wide * wide + wide + wide * vision.out_hidden_size + vision.out_hidden_size
        if vision.architecture == "qwen2_5_vl":  # gated MLPs, RMSNorms, the merger
            layer = 4 * (v * v + v) + 3 * (v * f + f) - f + v + 2 * v
            return patch + vision.num_hidden_layers * layer + v + mlp
        # Qwen3-VL: biased patches, learned positions, plain MLPs, LayerNorms, the merger
        # and the DeepStack mergers (normed after the shuffle)
        layer = 4 * (v * v + v) + 2 * v * f + f + v + 4 * v
        return (patch + v + vision.num_position_embeddings * v
                + vision.num_hidden_layers * layer + 2 * v + mlp
                + len(vision.deepstack_layers) * (2 * wide + mlp))
    positions = vision.num_patches + int(vision.has_class_token)
    # patches, positions, and SigLIP's patch bias or CLIP's class token
    embeddings = vision.num_channels * vision.patch_size ** 2 * v + positions * v + v
    norms = (2 * v if vision.tower == "clip" else 0) + 2 * v  # pre- and post-layernorm
    layer = 4 * (v * v + v) + 2 * v * f + f + v + 4 * v
    if vision.pooled:  # Gemma 3: the soft-embedding norm and the projection
        projector = v + v * t
    elif vision.tiled:  # Idefics3: the pixel-shuffled rows' projection
        projector = v * vision.scale_factor ** 2 * t
    else:  # LLaVA's two-layer MLP
        projector = v * t + t * t + (2 * t if vision.projector_bias else 0)
    return embeddings + norms + vision.num_hidden_layers * layer + projector


def _qk_norm_size(cfg: ModelConfig) -> int:
    if cfg.qk_norm_across_heads:
        return (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    return 2 * cfg.head_dim


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights at `dtype` (the unquantized compute copy)."""
    return parameter_counts(cfg)[0] * DTYPE_BYTES[dtype]


def rank_config(cfg: ModelConfig, tensor_parallel_size: int, rank: int) -> ModelConfig:
    """The shape of one tensor-parallel rank's share (`distributed/parallel.py`): its query
    and KV heads, intermediate channels and vocabulary rows; `weight_bytes`,
    `quantized_weight_bytes` and `kv_bytes_per_token` of it are that rank's."""
    from llmserve.distributed.parallel import ShardPlan, TensorParallel

    experts = cfg.moe.num_experts if cfg.moe else 0
    plan = ShardPlan.build(TensorParallel(rank, tensor_parallel_size), cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size,
                           experts)
    moe = dataclasses.replace(cfg.moe, num_experts=len(plan.experts),
                              top_k=min(cfg.moe.top_k, len(plan.experts))) if experts else None
    return dataclasses.replace(
        cfg, num_attention_heads=len(plan.attention.q_heads),
        num_key_value_heads=len(plan.attention.kv_heads), intermediate_size=len(plan.mlp),
        vocab_size=len(plan.vocab), moe=moe)


def quantized_weight_bytes(cfg: ModelConfig, method: str) -> int:
    """Bytes the int8 or int4 path allocates: packed linears (int8: padded, int32 row sums,
    fp32 scales; int4: 320-byte records per 16 channels and group of 32), one int8 table
    for a tied embedding and head (an untied head packed as the linears, beside a float
    embedding), a mixture's float routers, fp32 norms and rotary tables (Gemma: four norms
    a layer, a second rotary base)."""
    from llmserve.quantization.int4 import packed_int4_bytes
    from llmserve.quantization.int8 import packed_int8_bytes

    # "kquant" at int8: a bound (kquant_weight_bytes counts a K-quant file's own records)
    packed = {"int8": packed_int8_bytes, "int4": packed_int4_bytes,
              "int4-a8": packed_int4_bytes, "kquant": packed_int8_bytes}[method]
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    gemma = cfg.architecture in ("gemma2", "gemma3")  # four norms a layer, two rotary bases
    layer = packed(q + 2 * kv, h) + packed(h, q) + 4 * (4 if gemma else 2) * h
    if cfg.attention_bias:
        layer += 4 * (q + 2 * kv)
    if cfg.qk_norm:
        layer += 4 * _qk_norm_size(cfg)
    total = cfg.num_hidden_layers * layer
    moe = cfg.moe
    for index in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(index):
            total += packed(2 * i, h) + packed(h, i)
            continue
        # the experts' linears packed, the router (and the shared expert's gate) fp32
        width, shared = moe.intermediate_size, moe.shared_intermediate_size
        total += moe.num_experts * (packed(2 * width, h) + packed(h, width) + 4 * h)
        if shared:
            total += packed(2 * shared, h) + packed(h, shared) + 4 * h
    # a tied head is int8 under every format (QUANTIZED_HEADS); an untied one is a linear
    # like the others
    head = packed_int8_bytes(cfg.vocab_size, h) if cfg.tie_word_embeddings else \
        packed(cfg.vocab_size, h)
    embed = 0 if cfg.tie_word_embeddings else 4 * cfg.vocab_size * h
    rotary = (2 if gemma else 1) * 2 * 4 * cfg.max_position_embeddings * d
    return total + head + embed + 4 * h + rotary + 4 * vision_parameter_count(cfg)


def kquant_weight_bytes(cfg: ModelConfig, types: dict[str, Any]) -> int:
    """Bytes the K-quant path allocates for a GGUF file whose tensors have `types` (GGUF
    name -> type): each linear whose parts are all K-quant packed in their own records
    (`packed_kquant_bytes`), the others at int8 (`KQUANT_FALLBACK`), the tied head on the
    embedding's blocks or int8, an untied embedding on its blocks where they pack; the rest
    as `quantized_weight_bytes`; a mixture's experts each on its slice of the file's 3-D
    tensors, fused file tensors (Phi-3's) as one linear."""
    from llmserve.quantization.int8 import packed_int8_bytes
    from llmserve.quantization.kquant import packed_kquant_bytes

    def linear(parts: list[tuple[str, int]], columns: int) -> int:
        kquant = packed_kquant_bytes([(types.get(name), rows) for name, rows in parts], columns)
        return kquant if kquant is not None else packed_int8_bytes(
            sum(rows for _, rows in parts), columns)

    def mlp(blk: str, suffix: str, width: int) -> int:  # its bytes past int8's
        gate_up = [(f"{blk}ffn_gate{suffix}.weight", width), (f"{blk}ffn_up{suffix}.weight", width)]
        if gate_up[0][0] not in types:  # Phi-3's fused gate and up
            gate_up = [(f"{blk}ffn_up{suffix}.weight", 2 * width)]
        return (linear(gate_up, h) - packed_int8_bytes(2 * width, h)
                + linear([(f"{blk}ffn_down{suffix}.weight", h)], width)
                - packed_int8_bytes(h, width))

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    total = quantized_weight_bytes(cfg, "int8")
    int8_total = total
    for n in range(cfg.num_hidden_layers):
        blk = f"blk.{n}."
        qkv = [(blk + "attn_q.weight", q), (blk + "attn_k.weight", kv),
               (blk + "attn_v.weight", kv)]
        if blk + "attn_qkv.weight" in types:  # Phi-3's fused projection
            qkv = [(blk + "attn_qkv.weight", q + 2 * kv)]
        total += linear(qkv, h) - packed_int8_bytes(q + 2 * kv, h)
        total += linear([(blk + "attn_output.weight", h)], q) - packed_int8_bytes(h, q)
        if not cfg.is_moe_layer(n):
            total += mlp(blk, "", i)
            continue
        moe = cfg.moe  # each expert on its slice of the 3-D tensors, the shared expert's own
        total += moe.num_experts * mlp(blk, "_exps", moe.intermediate_size)
        if moe.shared_intermediate_size:
            total += mlp(blk, "_shexp", moe.shared_intermediate_size)
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    total += linear([(head, cfg.vocab_size)], h) - packed_int8_bytes(cfg.vocab_size, h)
    if not cfg.tie_word_embeddings:  # an untied embedding on its blocks, else float32
        embed = packed_kquant_bytes([(types.get("token_embd.weight"), cfg.vocab_size)], h)
        total += 0 if embed is None else embed - 4 * cfg.vocab_size * h
    return total if total > 0 else int8_total


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


def plan_kv_cache(
    cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, block_size: int,
    num_kv_heads: int | None = None, extra_layers: int = 0, num_layers: int | None = None,
) -> KVCachePlan:
    """How many blocks of `block_size` tokens fit in `budget_bytes`; deterministic.
    `num_kv_heads`: the heads one tensor-parallel rank holds (default: all);
    `extra_layers`: layers of the same shape after the model's (an EAGLE head's);
    `num_layers`: the model's layers one rank holds (a pipeline stage's; default all)."""
    per_layer = kv_bytes_per_token(cfg, dtype, num_kv_heads) // cfg.num_hidden_layers
    per_token = per_layer * ((num_layers or cfg.num_hidden_layers) + extra_layers)
    num_blocks = budget_bytes // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError(
            f"the KV-cache budget ({budget_bytes} bytes) holds less than one block of "
            f"{block_size} tokens ({per_token * block_size} bytes); raise --kv-cache-memory"
        )
    return KVCachePlan(num_blocks, block_size, per_token)
