"""A projector file as llama.cpp writes it (`--mmproj`: `general.architecture` "clip",
`clip.*` metadata, `v.*` tower and `mm.*` projector tensors): a vision tower and projector
for a GGUF decoder.

* `clip.projector_type` "mlp" (LLaVA): the tower runs as llama.cpp runs a LLaVA
  projector: the hidden states after all layers but the last, CLIP's class token dropped
  (a SigLIP tower, which has none, keeps every patch), the two-layer MLP;
* "gemma3": the SigLIP tower's normed output pooled `clip.vision.projector.scale_factor`
  (default 4) patches a side, `mm.soft_emb_norm` (stored as 1 + weight) and
  `mm.input_projection`; the decoder is Gemma 3's, each image between its
  <start_of_image> and <end_of_image> tokens, attending to itself both ways;
* "idefics3" (SmolVLM, Idefics3): an image cut into tiles of the tower's size after its
  longest edge is resized to `clip.vision.preproc_image_size`, each tile's normed output
  pixel-shuffled `clip.vision.projector.scale_factor` a side and projected (`mm.model.fc`);
  the decoder's vocabulary has the image and tile tokens;
* "qwen2.5vl_merger" (Qwen2.5-VL): its ViT (the Conv3d patch embedding stored as two 2-D
  kernels, q/k/v split, RMSNorms, gated MLPs; layers `n_wa_pattern - 1`, `2 n_wa_pattern
  - 1`, ... over the whole image, the rest in windows) and merger (`v.post_ln`, `mm.0`,
  `mm.2`); images of any size, between 8 and 4,096 tokens (llama.cpp's bounds, or the
  file's `clip.vision.image_min_pixels` / `image_max_pixels`); the decoder a `qwen2vl`
  GGUF (M-RoPE) whose vocabulary has `<|image_pad|>`;
* "qwen3vl_merger" (Qwen3-VL): its ViT (the patch embedding as above with its bias,
  learned positions `v.position_embd`, q/k/v fused or split, LayerNorms, plain GELU MLPs,
  every layer over the whole image), merger (`v.post_ln`, `mm.0`, `mm.2`) and DeepStack
  mergers (`v.deepstack.{layer}.norm/fc1/fc2`); the decoder a `qwen3vl` GGUF
  (interleaved M-RoPE) with as many `n_deepstack_layers`.

Images are preprocessed as the tower's Hugging Face processor would (CLIP: shortest edge
and centre crop; SigLIP: a fixed resize, bilinear for Gemma 3) with the file's mean and
std. Files of llama.cpp's older converters that named a layer's fc1 `ffn_down` (and fc2
`ffn_up`) are read by the matrices' shapes, as llama.cpp reads them.
"""

import dataclasses
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
from llmserve.multimodal.processors import (
    BICUBIC,
    BILINEAR,
    LANCZOS,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessor,
    MergedImageProcessor,
    TiledImageProcessor,
)

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
                "mm.2": "multi_modal_projector.linear_2",
                "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
                "mm.model.fc": "multi_modal_projector.proj"}
INPUT_PROJECTION = "mm.input_projection.weight"  # Gemma 3's, a (vision, text) matrix
PROJECTOR_TYPES = ("mlp", "gemma3", "idefics3", "qwen2.5vl_merger", "qwen3vl_merger")
FAMILIES = {"mlp": "LLaVA", "gemma3": "Gemma 3", "idefics3": "Idefics3",
            "qwen2.5vl_merger": "Qwen2.5-VL", "qwen3vl_merger": "Qwen3-VL"}
QWEN_PROJECTORS = {"qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl"}
# Qwen2.5-VL's `v.blk.{i}.<name>` -> `vision_tower.blocks.{i}.<name>` (q, k and v fused)
QWEN_LAYER_NAMES = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}
QWEN_GLOBAL_NAMES = {"v.post_ln": "vision_tower.merger.ln_q",
                     "mm.0": "vision_tower.merger.mlp.0", "mm.2": "vision_tower.merger.mlp.2"}
# Qwen3-VL's (its DeepStack mergers' `v.deepstack.{layer}.<name>` beside)
QWEN3_LAYER_NAMES = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
                     "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
QWEN3_GLOBAL_NAMES = {"v.post_ln": "vision_tower.merger.norm",
                      "mm.0": "vision_tower.merger.linear_fc1",
                      "mm.2": "vision_tower.merger.linear_fc2",
                      "v.patch_embd": "vision_tower.patch_embed.proj",
                      "v.position_embd": "vision_tower.pos_embed"}
DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
# llama.cpp's bounds on a Qwen2.5-VL image's tokens (its `set_limit_image_tokens(8, 4096)`)
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096
QWEN_WINDOW = 112  # px a side of its windows: llama.cpp's, whatever the file says
CLASS_EMBEDDING = "v.class_embd"


@dataclass
class Projector:
    vision: VisionConfig
    tensors: dict[str, torch.Tensor]  # under the model's names (`models/vision_language.py`)
    processor: ImageProcessor | TiledImageProcessor | MergedImageProcessor


def read_mmproj(path: str | Path, dtype: torch.dtype = torch.float32) -> Projector:
    """The projector file at `path`, its tensors dequantized to `dtype`. Refused by name:
    another projector type than LLaVA's MLP, Gemma 3's or Idefics3's, a tower without its
    tensors."""
    path = require_path(path, is_dir=False)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder",
                                                                   True):
        raise ModelFormatError(f"{path} is not a vision projector file (general.architecture "
                               f"{meta.get('general.architecture')!r}, not 'clip')")
    kind = meta.get("clip.projector_type", "mlp")
    if kind not in PROJECTOR_TYPES:
        raise UnsupportedModelError(f"{path}: projector type {kind!r} is not supported "
                                    f"(LLaVA's 'mlp', Gemma 3's 'gemma3', SmolVLM's "
                                    f"'idefics3', Qwen2.5-VL's 'qwen2.5vl_merger', "
                                    f"Qwen3-VL's 'qwen3vl_merger')")
    by_name = {t.name: t for t in reader.tensors}
    if kind in QWEN_PROJECTORS:
        return _qwen_projector(path, meta, by_name, dtype, QWEN_PROJECTORS[kind])
    clip = CLASS_EMBEDDING in by_name
    if kind != "mlp" and clip:
        raise ModelFormatError(f"{path}: a {FAMILIES[kind]} projector's tower is SigLIP-"
                               f"shaped (it has a class embedding)")
    vision = _vision_config(path, meta, clip, kind)
    tensors = {}
    for name, tensor in by_name.items():
        target = "multi_modal_projector.mm_input_projection_weight" \
            if name == INPUT_PROJECTION and kind == "gemma3" else _model_name(name)
        if target is None:
            raise ModelFormatError(f"{path}: tensor {name!r} has no place in a "
                                   f"{FAMILIES[kind]} tower")
        weight = tensor_to_torch(tensor)
        if name == CLASS_EMBEDDING:
            weight = weight.reshape(-1)
        if target.endswith("mm_soft_emb_norm.weight"):
            weight = weight - 1  # stored as Gemma's 1 + weight
        tensors[target] = weight.to(dtype)
    _unswap_fc(tensors, vision)
    if "vision_tower.post_layernorm.weight" not in tensors:  # converters leave it out
        tensors["vision_tower.post_layernorm.weight"] = torch.ones(vision.hidden_size, dtype=dtype)
        tensors["vision_tower.post_layernorm.bias"] = torch.zeros(vision.hidden_size, dtype=dtype)
    side = vision.image_size
    mean = tuple(meta.get("clip.vision.image_mean", (0.5,) * 3))
    std = tuple(meta.get("clip.vision.image_std", (0.5,) * 3))
    resample = BILINEAR if vision.pooled else BICUBIC
    if vision.tiled:
        edge = int(meta.get("clip.vision.preproc_image_size", 4 * side) or 4 * side)
        processor = TiledImageProcessor(edge, side, True, LANCZOS, 1 / 255, mean, std)
    elif clip:
        processor = ImageProcessor(None, side, BICUBIC, (side, side), 1 / 255, mean, std)
    else:
        processor = ImageProcessor((side, side), None, resample, None, 1 / 255, mean, std)
    return Projector(vision, tensors, processor)


def projector_family(projector: Projector) -> str:
    """The family a projector's images are for, in words."""
    return FAMILIES[_projector_kind(projector.vision)]


def _qwen_projector(path: Path, meta: dict[str, Any], by_name: dict[str, Any],
                    dtype: torch.dtype, family: str) -> Projector:
    """A Qwen2.5-VL or Qwen3-VL (`family` "qwen2_5_vl" / "qwen3_vl") projector file: its
    tower and mergers under the model's names."""
    def number(key: str, default: Any = None) -> Any:
        value = meta.get(f"clip.vision.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path} lacks clip.vision.{key}")
        return value

    qwen3 = family == "qwen3_vl"
    name = FAMILIES["qwen3vl_merger" if qwen3 else "qwen2.5vl_merger"]
    try:
        depth = int(number("block_count"))
        merger_out = by_name.get("mm.2.weight")
        if merger_out is None:
            raise ModelFormatError(f"{path} lacks mm.2.weight")
        tower = {
            "model_type": f"{family}_vision",
            "hidden_size": int(number("embedding_length")),
            "intermediate_size": int(number("feed_forward_length")), "depth": depth,
            "num_heads": int(number("attention.head_count")),
            "patch_size": int(number("patch_size")),
            "spatial_merge_size": int(number("spatial_merge_size", 2)),
            "out_hidden_size": int(merger_out.shape[1])}
        if qwen3:
            positions = by_name.get("v.position_embd.weight")
            if positions is None:
                raise ModelFormatError(f"{path} lacks v.position_embd.weight")
            tower |= {"num_position_embeddings": int(positions.shape[1]),
                      "deepstack_visual_indexes": _deepstack_layers(meta, by_name, depth)}
        else:
            pattern = int(number("n_wa_pattern", 0))
            # no window pattern: every layer over the whole image
            tower |= {"window_size": QWEN_WINDOW, "fullatt_block_indexes": [
                i for i in range(depth) if not pattern or (i + 1) % pattern == 0]}
        vision = VisionConfig.from_hf_config(
            {"model_type": family, "vision_config": tower, "image_token_id": 0})
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: {e}") from None
    vision = dataclasses.replace(vision, image_token_in_vocabulary=False)
    layer_names = QWEN3_LAYER_NAMES if qwen3 else QWEN_LAYER_NAMES
    global_names = QWEN3_GLOBAL_NAMES if qwen3 else QWEN_GLOBAL_NAMES
    tensors: dict[str, torch.Tensor] = {}
    frames: dict[str, torch.Tensor] = {}  # the patch embedding's two 2-D kernels
    qkv: dict[str, dict[str, torch.Tensor]] = {}  # each layer's q, k, v, to be fused
    for tensor_name, tensor in by_name.items():
        weight = tensor_to_torch(tensor).to(dtype)
        stem, _, leaf = tensor_name.rpartition(".")
        match = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", stem)
        deep = re.fullmatch(r"v\.deepstack\.(\d+)\.(\w+)", stem)
        if tensor_name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            frames[tensor_name] = weight
        elif match and match.group(2) in ("attn_q", "attn_k", "attn_v"):
            qkv.setdefault(f"vision_tower.blocks.{match.group(1)}.attn.qkv.{leaf}", {})[
                match.group(2)] = weight
        elif match and match.group(2) == "attn_qkv":
            tensors[f"vision_tower.blocks.{match.group(1)}.attn.qkv.{leaf}"] = weight
        elif match and match.group(2) in layer_names:
            tensors[f"vision_tower.blocks.{match.group(1)}."
                    f"{layer_names[match.group(2)]}.{leaf}"] = weight
        elif stem in global_names:
            tensors[f"{global_names[stem]}.{leaf}"] = weight.reshape(-1, weight.shape[-1]) \
                if stem == "v.position_embd" else weight
        elif qwen3 and deep and int(deep.group(1)) in vision.deepstack_layers \
                and deep.group(2) in DEEPSTACK_NAMES:
            k = vision.deepstack_layers.index(int(deep.group(1)))
            tensors[f"vision_tower.deepstack_merger_list.{k}."
                    f"{DEEPSTACK_NAMES[deep.group(2)]}.{leaf}"] = weight
        else:
            raise ModelFormatError(f"{path}: tensor {tensor_name!r} has no place in a "
                                   f"{name} tower")
    if len(frames) != 2:
        raise ModelFormatError(f"{path} lacks v.patch_embd.weight and its second frame's "
                               f"v.patch_embd.weight.1")
    # the Conv3d (hidden, C, frames, p, p), each frame's kernel stored as a 2-D one
    tensors["vision_tower.patch_embed.proj.weight"] = torch.stack(
        [frames["v.patch_embd.weight"], frames["v.patch_embd.weight.1"]], dim=2)
    for target, parts in qkv.items():
        if set(parts) != {"attn_q", "attn_k", "attn_v"}:
            raise ModelFormatError(f"{path}: {target} lacks one of q, k and v")
        tensors[target] = torch.cat([parts["attn_q"], parts["attn_k"], parts["attn_v"]])
    side = vision.merged_patch
    processor = MergedImageProcessor(
        int(meta.get("clip.vision.image_min_pixels") or QWEN_MIN_TOKENS * side * side),
        int(meta.get("clip.vision.image_max_pixels") or QWEN_MAX_TOKENS * side * side),
        vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size, BICUBIC,
        1 / 255, tuple(meta.get("clip.vision.image_mean", OPENAI_CLIP_MEAN)),
        tuple(meta.get("clip.vision.image_std", OPENAI_CLIP_STD)))
    return Projector(vision, tensors, processor)


def _deepstack_layers(meta: dict[str, Any], by_name: dict[str, Any], depth: int) -> list[int]:
    """A Qwen3-VL tower's DeepStack layers: `clip.vision.is_deepstack_layers` (a flag a
    layer), else the layers with `v.deepstack.{layer}.*` tensors."""
    flags = meta.get("clip.vision.is_deepstack_layers")
    if isinstance(flags, list | tuple):
        if len(flags) != depth:
            raise ValueError(f"clip.vision.is_deepstack_layers has {len(flags)} flags for "
                             f"{depth} layers")
        return [i for i, flag in enumerate(flags) if flag]
    found = {int(m.group(1)) for name in by_name
             if (m := re.match(r"v\.deepstack\.(\d+)\.", name))}
    return sorted(found)


def _projector_kind(vision: VisionConfig) -> str:
    """The projector type a tower's file says (`clip.projector_type`)."""
    if vision.merged:
        return "qwen3vl_merger" if vision.architecture == "qwen3_vl" else "qwen2.5vl_merger"
    return "gemma3" if vision.pooled else "idefics3" if vision.tiled else "mlp"


def _unswap_fc(tensors: dict[str, torch.Tensor], vision: VisionConfig) -> None:
    """fc1 is (intermediate, hidden): a file that put it under `ffn_down` gets its two
    matrices (and biases) swapped back."""
    if vision.intermediate_size == vision.hidden_size:
        return
    for layer in range(vision.num_hidden_layers):
        stem = f"vision_tower.encoder.layers.{layer}.mlp."
        fc1 = tensors.get(stem + "fc1.weight")
        if fc1 is not None and fc1.shape[0] == vision.hidden_size:
            for leaf in ("weight", "bias"):
                a, b = stem + f"fc1.{leaf}", stem + f"fc2.{leaf}"
                if a in tensors and b in tensors:
                    tensors[a], tensors[b] = tensors[b], tensors[a]


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


def _vision_config(path: Path, meta: dict[str, Any], clip: bool, kind: str) -> VisionConfig:
    def number(key: str) -> Any:
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise ModelFormatError(f"{path} lacks clip.vision.{key}")
        return value

    gelu = bool(meta.get("clip.use_gelu", False))
    try:
        tower = dict(
            hidden_size=int(number("embedding_length")),
            intermediate_size=int(number("feed_forward_length")),
            num_hidden_layers=int(number("block_count")),
            num_attention_heads=int(number("attention.head_count")),
            image_size=int(number("image_size")), patch_size=int(number("patch_size")),
            num_channels=3, layer_norm_eps=float(number("attention.layer_norm_epsilon")),
            projector_act="gelu", image_token_id=0,  # the decoder's, set at load
            image_token_in_vocabulary=False)
        scale = meta.get("clip.vision.projector.scale_factor")
        if kind != "mlp":  # SigLIP-shaped towers read at their last layer's normed output
            tower |= dict(tower="siglip", hidden_act="gelu_pytorch_tanh", feature_layer=-1,
                          select_strategy="full", projector_bias=False)
        if kind == "idefics3":
            return VisionConfig(architecture="idefics3", scale_factor=int(scale or 2), **tower)
        if kind == "gemma3":
            pooled = tower["image_size"] // tower["patch_size"] // int(scale or 4)
            return VisionConfig(architecture="gemma3", mm_tokens_per_image=pooled * pooled,
                                begin_image_token_id=0, end_image_token_id=0, **tower)
        return VisionConfig(
            architecture="llava", tower="clip" if clip else "siglip",
            # ggml's GELU is the tanh form
            hidden_act=("gelu" if clip else "gelu_pytorch_tanh") if gelu else "quick_gelu",
            feature_layer=-2, select_strategy="default" if clip else "full",
            projector_bias=True, **tower)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: {e}") from None


# a family's image token first, then those its prompts write around images
IMAGE_TOKENS = {"gemma3": ("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
                "idefics3": ("<image>", "<fake_token_around_image>", "<global-img>"),
                "qwen2.5vl_merger": ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
                "qwen3vl_merger": ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}


def image_tokens(config: Any, vision: VisionConfig, tokenizer: Any,
                 path: str | Path) -> VisionConfig:
    """A Gemma 3, Idefics3, Qwen2.5-VL or Qwen3-VL projector's image side with its
    decoder's image tokens (their vocabularies have them: an image is written as
    transformers' processor writes it); refused by name for a decoder of another family
    or a vocabulary without them."""
    kind = _projector_kind(vision)
    if (config.architecture == "gemma3") != (kind == "gemma3") or (
            config.mrope_section is not None) != vision.merged:
        raise ModelFormatError(f"{path} is a {FAMILIES[kind]} projector; the model is "
                               f"{config.architecture!r}")
    names = IMAGE_TOKENS[kind]
    ids = [tokenizer.token_to_id(token) for token in names]
    missing = [t for t, i in zip(names, ids, strict=True) if i is None]
    if missing:
        raise ModelFormatError(f"the model's vocabulary lacks {', '.join(missing)}, which a "
                               f"{FAMILIES[kind]} projector's images need")
    vision = dataclasses.replace(vision, image_token_id=ids[0], image_token_in_vocabulary=True)
    if kind == "gemma3":
        vision = dataclasses.replace(vision, begin_image_token_id=ids[1],
                                     end_image_token_id=ids[2])
    return vision
