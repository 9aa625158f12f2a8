"""Write a Hugging Face decoder (Llama, Qwen2/3 and their mixtures of experts, Mixtral,
OLMoE) as a GGUF file laid out as llama.cpp's converter lays it out: its tensor names, Q/K
rows permuted for the "llama" architecture, each layer's experts stacked into one 3-D
tensor per projection, the metadata keys llama.cpp reads. The GGUF reference tests write
tiny random checkpoints with it; benchmarks/moe.py writes its MoE and dense models with it,
and llama.cpp's llama-bench runs those files."""

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from llmserve.loader.mmproj import (
    DEEPSTACK_NAMES,
    GLOBAL_NAMES,
    LAYER_NAMES,
    QWEN3_GLOBAL_NAMES,
    QWEN3_LAYER_NAMES,
    QWEN_GLOBAL_NAMES,
    QWEN_LAYER_NAMES,
)

# Hugging Face `model_type` -> GGUF `general.architecture`
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
# Gemma 2's and 3's four norms a layer; Phi-3's fused projections
GEMMA = {"post_attention_layernorm.weight": "post_attention_norm.weight",
         "pre_feedforward_layernorm.weight": "ffn_norm.weight",
         "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
PHI3 = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
           "down_proj": "ffn_down_exps.weight"}
MIXTRAL = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
           ".w2.": ".down_proj."}


def write_gguf(model: torch.nn.Module, path: Path, qtype: QT = QT.F32,
               metadata: dict[str, Any] | None = None,
               types: dict[str, QT] | None = None, arch: str | None = None) -> Path:
    """`model` (a transformers CausalLM) as a GGUF file at `path`: 2-D and 3-D linear
    weights in `qtype` (F32, F16, Q8_0, Q4_0, Q4_K, ...), norms, biases and the router in
    F32; `types`: other types for some matrices, by GGUF name or its part after
    `blk.N.` (a Q4_K_M-like mix: {"attn_v.weight": QT.Q6_K, "token_embd.weight": QT.Q6_K});
    `metadata`: more key/values (a tokenizer's `tokenizer.ggml.*`); `arch`: another
    `general.architecture` than the model type's (a Qwen2 decoder as Qwen2.5-VL's
    "qwen2vl")."""
    config = model.config
    model_type = config.model_type
    arch = arch or GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    if types:
        writer = _TypedWriter(writer, types)
    _write_hparams(writer, arch, config)
    for key, value in (metadata or {}).items():
        add_metadata(writer, key, value)
    state = {_canonical(name): t.detach().float() for name, t in model.state_dict().items()}
    gemma = arch in ("gemma2", "gemma3")
    if gemma:  # llama.cpp stores Gemma's norms as 1 + weight
        state = {name: t + 1 if name.endswith("norm.weight") else t for name, t in state.items()}
    names = LAYER | (GEMMA if gemma else {}) | (PHI3 if arch == "phi3" else {})
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    stacked: dict[tuple[int, str], torch.Tensor] = {}  # (layer, projection) -> (E, rows, cols)
    for name, tensor in state.items():
        if name == "model.embed_tokens.weight":
            _add(writer, "token_embd.weight", tensor, qtype)
        elif name == "model.norm.weight":
            _add(writer, "output_norm.weight", tensor, QT.F32)
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                _add(writer, "output.weight", tensor, qtype)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # transformers' fused 3-D experts
            layer, half = int(name.split(".")[2]), tensor.shape[1] // 2
            stacked[(layer, "gate_proj")] = tensor[:, :half]
            stacked[(layer, "up_proj")] = tensor[:, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            stacked[(int(name.split(".")[2]), "down_proj")] = tensor
        elif ".mlp.experts." in name:  # one expert's projection, stacked below
            layer = int(name.split(".")[2])
            expert, projection = name.split(".mlp.experts.")[1].split(".")[:2]
            experts.setdefault((layer, projection), {})[int(expert)] = tensor
        else:
            layer = int(name.split(".")[2])
            key = names[name.split(".", 3)[3]]
            if arch == "llama" and key in ("attn_q.weight", "attn_k.weight"):
                heads = config.num_attention_heads if key == "attn_q.weight" else \
                    config.num_key_value_heads
                tensor = _permute(tensor, heads)
            if key == "ffn_gate_inp_shexp.weight":
                tensor = tensor.reshape(-1)
            quantized = tensor.dim() == 2 and key != "ffn_gate_inp.weight" and \
                key != "ffn_gate_inp_shexp.weight"
            _add(writer, f"blk.{layer}.{key}", tensor, qtype if quantized else QT.F32)
    for (layer, projection), by_expert in experts.items():
        stacked[(layer, projection)] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    for (layer, projection), tensor in sorted(stacked.items()):
        _add(writer, f"blk.{layer}.{EXPERTS[projection]}", tensor.contiguous(), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _canonical(name: str) -> str:
    for old, new in MIXTRAL.items():
        name = name.replace(old, new)
    return name


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for the "llama" architecture."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class _TypedWriter:
    """A GGUFWriter whose quantized matrices take the type `types` names for them."""

    def __init__(self, writer: gguf.GGUFWriter, types: dict[str, QT]) -> None:
        self.writer, self.types = writer, types

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    def type_of(self, name: str, qtype: QT) -> QT:
        if qtype in (QT.F32, QT.F16):
            return qtype
        return self.types.get(name, self.types.get(name.split(".", 2)[-1], qtype))


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype: QT) -> None:
    if isinstance(writer, _TypedWriter):
        writer, qtype = writer.writer, writer.type_of(name, qtype)
    array = tensor.numpy().astype(np.float32)
    if qtype == QT.F32:
        writer.add_tensor(name, array)
    elif qtype == QT.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype in K_QUANTIZERS:  # a 3-D tensor (experts) as its rows, then back
        blocks = K_QUANTIZERS[qtype](array.reshape(-1, array.shape[-1]))
        writer.add_tensor(name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


# ---- K-quants: gguf-py reads them but cannot write them; a plain quantizer here ----------
# (round to nearest on min/max scales, not llama.cpp's search: valid blocks, a little
# coarser than llama-quantize's)

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _kquant_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (..., 8) -> llama.cpp's 12 packed bytes."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = m[..., :4] | (m[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 0xF) | (m[..., 4:] & 0xF) << 4
    return out


def _quantize_q45k(array: np.ndarray, bits: int) -> np.ndarray:
    rows, cols = array.shape
    x = array.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    scale, mn = (x.max(-1) - lo) / (2**bits - 1), -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63)
    m = np.clip(np.round(mn / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63)
    step, offset = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
    q = np.clip(np.round((x + offset) / np.where(step > 0, step, 1)), 0, 2**bits - 1)
    q = q.astype(np.uint8).reshape(rows, cols // 256, 4, 2, 32)  # (chunk of 64, half, l)
    qs = (q[..., 0, :] & 0xF) | (q[..., 1, :] & 0xF) << 4  # (rows, blocks, 4, 32)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _kquant_scales(sc, m)]
    if bits == 5:
        hb = q >> 4  # (rows, blocks, 4 chunks, 2 halves, 32)
        qh = sum((hb[..., c, h, :] << (2 * c + h)) for c in range(4) for h in range(2))
        parts.append(qh.astype(np.uint8))
    parts.append(qs.reshape(rows, cols // 256, 128))
    blocks = np.concatenate([p.reshape(rows, cols // 256, -1) for p in parts], axis=-1)
    return blocks.reshape(rows, -1)


def _quantize_q6k(array: np.ndarray) -> np.ndarray:
    rows, cols = array.shape
    x = array.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -128, 127)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(x / np.where(step > 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, cols // 256, 2, 4, 32)  # (half, quarter of 32, l)
    ql = np.concatenate([(q[..., 0, :] & 0xF) | (q[..., 2, :] & 0xF) << 4,
                         (q[..., 1, :] & 0xF) | (q[..., 3, :] & 0xF) << 4], axis=-1)
    qh = sum((q[..., i, :] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
    parts = [ql, qh, sc.astype(np.int8).view(np.uint8).reshape(rows, cols // 256, 2, 8),
             _f16_bytes(d)]
    blocks = np.concatenate([p.reshape(rows, cols // 256, -1) for p in parts], axis=-1)
    return blocks.reshape(rows, -1)


K_QUANTIZERS = {QT.Q4_K: lambda a: _quantize_q45k(a, 4), QT.Q5_K: lambda a: _quantize_q45k(a, 5),
                QT.Q6_K: _quantize_q6k}


def _write_hparams(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's per layer type: the global layers'
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta",
                                                                    10000.0))))
    if arch == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", config.final_logit_softcapping)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":  # Phi-3: factor tensors and the original context
        original = config.original_max_position_embeddings
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        factor = config.max_position_embeddings / original
        writer.add_float32(f"{arch}.rope.scaling.attn_factor",
                           math.sqrt(1 + math.log(factor) / math.log(original)))
        for kind in ("short", "long"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def add_metadata(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"GGUF metadata {key}: {type(value).__name__}")


# a LLaVA tower's and projector's names (transformers 5.x layout) -> a projector file's:
# the reader's tables (`llmserve/loader/mmproj.py`) turned around
MMPROJ_LAYER = {model: file for file, model in LAYER_NAMES.items()}
MMPROJ_GLOBAL = {model.removeprefix("vision_tower."): file
                 for file, model in GLOBAL_NAMES.items() if file.startswith("v.")}


def write_mmproj(llava: torch.nn.Module, path: Path, qtype: QT = QT.F16,
                 legacy_fc_names: bool = False, preproc_image_size: int = 0) -> Path:
    """A transformers LLaVA's, Gemma 3's or SmolVLM's / Idefics3's vision tower and
    projector as the projector file llama.cpp's converter writes (`--mmproj`): `clip.*`
    metadata, `v.*` and `mm.*` tensors, matrices in `qtype`; SigLIP's pooling head left
    out, and LLaVA's post-layernorm, as the converter does; Gemma 3's soft-embedding norm
    as 1 + weight, its projection in F16; SmolVLM's scale factor and preprocessing size.
    `legacy_fc_names`: each layer's fc1 named `ffn_down` and fc2 `ffn_up`, as llama.cpp's
    older converters named them."""
    vision = llava.config.vision_config
    gemma3 = llava.config.model_type == "gemma3"
    tiled = llava.config.model_type in ("idefics3", "smolvlm")
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", not gemma3 and not tiled)
    writer.add_string("clip.projector_type",
                      "gemma3" if gemma3 else "idefics3" if tiled else "mlp")
    writer.add_bool("clip.use_gelu", vision.hidden_act != "quick_gelu")
    for key, value in {"image_size": vision.image_size, "patch_size": vision.patch_size,
                       "embedding_length": vision.hidden_size,
                       "feed_forward_length": vision.intermediate_size,
                       "block_count": vision.num_hidden_layers,
                       "attention.head_count": vision.num_attention_heads,
                       "projection_dim": llava.config.text_config.hidden_size}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.layer_norm_eps)
    if gemma3:
        per_side = int(round(llava.config.mm_tokens_per_image ** 0.5))
        scale = vision.image_size // vision.patch_size // per_side
        if scale != 4:  # llama.cpp's converter writes it only then
            writer.add_uint32("clip.vision.projector.scale_factor", scale)
    if tiled:
        writer.add_uint32("clip.vision.projector.scale_factor", llava.config.scale_factor)
        writer.add_uint32("clip.vision.preproc_image_size", preproc_image_size)
    clip = vision.model_type == "clip_vision_model"
    mean, std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)) \
        if clip else ((0.5,) * 3, (0.5,) * 3)
    writer.add_array("clip.vision.image_mean", list(mean))
    writer.add_array("clip.vision.image_std", list(std))
    layer_names = MMPROJ_LAYER | ({"mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up"}
                                  if legacy_fc_names else {})
    for name, tensor in llava.state_dict().items():
        tensor = tensor.detach().float()
        for prefix in ("model.vision_tower.vision_model.", "model.vision_tower.",
                       "model.vision_model."):
            name = name.replace(prefix, "vision_tower.")
        name = name.replace("model.multi_modal_projector.", "multi_modal_projector.")
        if name.startswith("vision_tower.head.") or (
                "post_layernorm" in name and not gemma3 and not tiled):
            continue
        kind = qtype if tensor.dim() >= 2 else QT.F32
        if name == "model.connector.modality_projection.proj.weight":
            target = "mm.model.fc.weight"
        elif name == "multi_modal_projector.mm_input_projection_weight":
            target, kind = "mm.input_projection.weight", QT.F16
        elif name == "multi_modal_projector.mm_soft_emb_norm.weight":
            target, tensor = "mm.soft_emb_norm.weight", tensor + 1
        elif name.startswith("multi_modal_projector."):
            part, leaf = name.split(".")[1:]
            target = {"linear_1": "mm.0", "linear_2": "mm.2"}[part] + f".{leaf}"
        elif name == "vision_tower.embeddings.class_embedding":
            target = "v.class_embd"
        elif name.startswith("vision_tower.encoder.layers."):
            layer, rest = name.removeprefix("vision_tower.encoder.layers.").split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            target = f"v.blk.{layer}.{layer_names[module]}.{leaf}"
        elif name.startswith("vision_tower."):
            module, leaf = name.removeprefix("vision_tower.").rsplit(".", 1)
            target = f"{MMPROJ_GLOBAL[module]}.{leaf}"
        else:
            continue  # the decoder: its own GGUF file
        _add(writer, target, tensor, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen_mmproj(model: torch.nn.Module, path: Path, qtype: QT = QT.F16) -> Path:
    """A transformers Qwen2.5-VL's tower and merger as llama.cpp's converter writes its
    projector file: `clip.projector_type` "qwen2.5vl_merger", the window pattern, the Conv3d's
    two frames as `v.patch_embd.weight` and `.weight.1`, q, k and v split."""
    vision = model.config.vision_config
    full = list(vision.fullatt_block_indexes)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen2.5vl_merger")
    writer.add_bool("clip.use_silu", True)
    for key, value in {"image_size": 560, "patch_size": vision.patch_size,
                       "embedding_length": vision.hidden_size,
                       "feed_forward_length": vision.intermediate_size,
                       "block_count": vision.depth,
                       "attention.head_count": vision.num_heads,
                       "projection_dim": vision.out_hidden_size,
                       "n_wa_pattern": full[0] + 1}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    layer_names = {model: file for file, model in QWEN_LAYER_NAMES.items()}
    global_names = {model.removeprefix("vision_tower."): file
                    for file, model in QWEN_GLOBAL_NAMES.items()}
    for module, leaf, tensor, kind in _visual_tensors(writer, model, qtype):
        if module.startswith("blocks."):
            _, layer, rest = module.split(".", 2)
            if rest == "attn.qkv":
                for part, piece in zip(("attn_q", "attn_k", "attn_v"), tensor.chunk(3),
                                       strict=True):
                    _add(writer, f"v.blk.{layer}.{part}.{leaf}", piece.contiguous(), kind)
                continue
            target = f"v.blk.{layer}.{layer_names[rest]}.{leaf}"
        else:
            target = f"{global_names[module]}.{leaf}"
        _add(writer, target, tensor, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen3_mmproj(model: torch.nn.Module, path: Path, qtype: QT = QT.F16) -> Path:
    """A transformers Qwen3-VL's tower, merger and DeepStack mergers as llama.cpp's
    converter writes its projector file: `clip.projector_type` "qwen3vl_merger", a flag a
    layer for DeepStack, the Conv3d's two frames and its bias, q/k/v fused as
    `attn_qkv`, each DeepStack merger under its layer's index."""
    vision = model.config.vision_config
    side = int(vision.num_position_embeddings ** 0.5)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen3vl_merger")
    writer.add_bool("clip.use_gelu", True)
    for key, value in {"image_size": side * vision.patch_size, "patch_size": vision.patch_size,
                       "embedding_length": vision.hidden_size,
                       "feed_forward_length": vision.intermediate_size,
                       "block_count": vision.depth, "attention.head_count": vision.num_heads,
                       "projection_dim": vision.out_hidden_size,
                       "spatial_merge_size": vision.spatial_merge_size}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.is_deepstack_layers", [
        i in vision.deepstack_visual_indexes for i in range(vision.depth)])
    layer_names = {model: file for file, model in QWEN3_LAYER_NAMES.items()}
    global_names = {model.removeprefix("vision_tower."): file
                    for file, model in QWEN3_GLOBAL_NAMES.items()}
    deep_names = {model: file for file, model in DEEPSTACK_NAMES.items()}
    for module, leaf, tensor, kind in _visual_tensors(writer, model, qtype):
        if module.startswith("blocks."):
            _, layer, rest = module.split(".", 2)
            target = f"v.blk.{layer}.attn_qkv.{leaf}" if rest == "attn.qkv" else \
                f"v.blk.{layer}.{layer_names[rest]}.{leaf}"
        elif module.startswith("deepstack_merger_list."):
            _, k, rest = module.split(".", 2)
            layer = vision.deepstack_visual_indexes[int(k)]
            target = f"v.deepstack.{layer}.{deep_names[rest]}.{leaf}"
        else:
            target = f"{global_names[module]}.{leaf}"
        if module == "pos_embed":
            kind = QT.F32
        _add(writer, target, tensor, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _visual_tensors(writer: gguf.GGUFWriter, model: torch.nn.Module, qtype: QT):
    """A Qwen-VL tower's tensors as (module, leaf, tensor, GGUF type), the Conv3d patch
    embedding's weight written here already as a 2-D kernel a frame (llama.cpp's
    `v.patch_embd.weight` and `.weight.1`); the decoder's left out (its own file)."""
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        name, tensor = name.removeprefix("model.visual."), tensor.detach().float()
        if name == "patch_embed.proj.weight":  # (hidden, C, 2, p, p)
            _add(writer, "v.patch_embd.weight", tensor[:, :, 0].contiguous(), QT.F32)
            _add(writer, "v.patch_embd.weight.1", tensor[:, :, 1].contiguous(), QT.F32)
            continue
        module, leaf = name.rsplit(".", 1)
        yield module, leaf, tensor, qtype if tensor.dim() >= 2 else QT.F32


def with_control_tokens(tokenizer: dict[str, Any], tokens: list[str]) -> tuple[dict, int]:
    """GGUF `tokenizer.*` metadata with `tokens` appended as control tokens (as vision
    models' GGUF files mark their image tokens), and the first one's id."""
    first = len(tokenizer["tokenizer.ggml.tokens"])
    types = tokenizer.get("tokenizer.ggml.token_type", [1] * first)
    return {**tokenizer, "tokenizer.ggml.tokens": [*tokenizer["tokenizer.ggml.tokens"], *tokens],
            "tokenizer.ggml.token_type": [*types, *[3] * len(tokens)]}, first
