"""A projector file as llama.cpp writes it (`--mmproj`: `general.architecture` "clip",
`clip.*` metadata, `v.*` tower and `mm.*` projector tensors): a LLaVA-style vision tower
and projector for a GGUF decoder.

Its tower runs as llama.cpp runs a LLaVA projector: the hidden states after all layers but
the last, CLIP's class token dropped (a SigLIP tower, which has none, keeps every patch),
the two-layer MLP (`clip.projector_type` "mlp"). Images are preprocessed as the tower's
Hugging Face processor would (CLIP: shortest edge and centre crop; SigLIP: a fixed
resize) with the file's mean and std.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve.config.vision import VisionConfig
from llmserve.errors import ModelFormatError, UnsupportedModelError
from llmserve.gguf_meta import open_gguf, read_metadata
from llmserve.loader.gguf import tensor_to_torch
from llmserve.loader.weights import require_path
from llmserve.multimodal import BICUBIC, ImageProcessor

# `v.blk.{i}.<name>` -> `vision_tower.encoder.layers.{i}.<name>`
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
               "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
               "ffn_down": "mlp.fc2"}
GLOBAL_NAMES = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
                "v.position_embd": "vision_tower.embeddings.position_embedding",
                "v.pre_ln": "vision_tower.pre_layrnorm",
                "v.post_ln": "vision_tower.post_layernorm",
                "mm.0": "multi_modal_projector.linear_1",
                "mm.2": "multi_modal_projector.linear_2"}
CLASS_EMBEDDING = "v.class_embd"


@dataclass
class Projector:
    vision: VisionConfig
    tensors: dict[str, torch.Tensor]  # under the model's names (`models/llava.py`)
    processor: ImageProcessor


def read_mmproj(path: str | Path, dtype: torch.dtype = torch.float32) -> Projector:
    """The projector file at `path`, its tensors dequantized to `dtype`. Refused by name:
    another projector type than LLaVA's MLP, a tower without its tensors."""
    path = require_path(path, is_dir=False)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder",
                                                                   True):
        raise ModelFormatError(f"{path} is not a vision projector file (general.architecture "
                               f"{meta.get('general.architecture')!r}, not 'clip')")
    kind = meta.get("clip.projector_type", "mlp")
    if kind != "mlp":
        raise UnsupportedModelError(f"{path}: projector type {kind!r} is not supported "
                                    f"(LLaVA's 'mlp')")
    by_name = {t.name: t for t in reader.tensors}
    clip = CLASS_EMBEDDING in by_name
    vision = _vision_config(path, meta, clip)
    tensors = {}
    for name, tensor in by_name.items():
        target = _model_name(name)
        if target is None:
            raise ModelFormatError(f"{path}: tensor {name!r} has no place in a LLaVA tower")
        weight = tensor_to_torch(tensor)
        if name == CLASS_EMBEDDING:
            weight = weight.reshape(-1)
        tensors[target] = weight.to(dtype)
    if "vision_tower.post_layernorm.weight" not in tensors:  # converters leave it out
        tensors["vision_tower.post_layernorm.weight"] = torch.ones(vision.hidden_size, dtype=dtype)
        tensors["vision_tower.post_layernorm.bias"] = torch.zeros(vision.hidden_size, dtype=dtype)
    side = vision.image_size
    mean = tuple(meta.get("clip.vision.image_mean", (0.5,) * 3))
    std = tuple(meta.get("clip.vision.image_std", (0.5,) * 3))
    processor = ImageProcessor(None, side, BICUBIC, (side, side), 1 / 255, mean, std) if clip \
        else ImageProcessor((side, side), None, BICUBIC, None, 1 / 255, mean, std)
    return Projector(vision, tensors, processor)


def _model_name(name: str) -> str | None:
    stem, _, leaf = name.rpartition(".")
    if name == CLASS_EMBEDDING:
        return "vision_tower.embeddings.class_embedding"
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{leaf}"
    match = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in LAYER_NAMES:
        return f"vision_tower.encoder.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.{leaf}"
    return None


def _vision_config(path: Path, meta: dict[str, Any], clip: bool) -> VisionConfig:
    def number(key: str) -> Any:
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise ModelFormatError(f"{path} lacks clip.vision.{key}")
        return value

    gelu = bool(meta.get("clip.use_gelu", False))
    try:
        return VisionConfig(
            architecture="llava", tower="clip" if clip else "siglip",
            hidden_size=int(number("embedding_length")),
            intermediate_size=int(number("feed_forward_length")),
            num_hidden_layers=int(number("block_count")),
            num_attention_heads=int(number("attention.head_count")),
            image_size=int(number("image_size")), patch_size=int(number("patch_size")),
            num_channels=3, layer_norm_eps=float(number("attention.layer_norm_epsilon")),
            # ggml's GELU is the tanh form
            hidden_act=("gelu" if clip else "gelu_pytorch_tanh") if gelu else "quick_gelu",
            feature_layer=-2, select_strategy="default" if clip else "full",
            projector_act="gelu", projector_bias=True, image_token_id=0,
            image_token_in_vocabulary=False)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: {e}") from None
