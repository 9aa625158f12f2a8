"""A vision-language model's image side (`VisionConfig`): its vision tower, the projector
into the decoder's embedding space and the image token, read from a Hugging Face
config.json (`vision_config` beside `text_config`): LLaVA's (a hidden state of the tower
through a two-layer MLP) or Gemma 3's (the tower's normed output average-pooled to
`mm_tokens_per_image` rows, RMS-normed and projected; each image between its begin and
end tokens, its tokens attending to each other both ways) or Idefics3's / SmolVLM's (an
image split into tiles of the tower's size plus the whole image shrunk to one, each
tile's normed output pixel-shuffled `scale_factor` a side and projected) or Qwen2.5-VL's
and Qwen3-VL's (a ViT of their own over an image of any size, 2 x 2 neighbouring patches
merged into one token; `models/qwen_vision.py`)."""

import math
from dataclasses import dataclass
from typing import Any

from llmserve.errors import UnsupportedModelError

# `vision_config.model_type` -> the tower's family: CLIP (a class token, a LayerNorm before
# the encoder) or SigLIP (neither; a biased patch embedding)
VISION_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip",
                 "idefics3_vision": "siglip", "smolvlm_vision": "siglip",
                 "qwen2_5_vl_vision": "qwen2_5_vit", "qwen2_5_vl": "qwen2_5_vit",
                 "qwen3_vl_vision": "qwen3_vit", "qwen3_vl": "qwen3_vit"}
# vision-language `model_type`s (the decoder is `text_config`'s: `models/llama.py`'s for
# LLaVA, `models/gemma3.py`'s for Gemma 3)
VISION_ARCHITECTURES = ("llava", "gemma3", "idefics3", "smolvlm", "qwen2_5_vl", "qwen3_vl")
TOWER_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")
PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu")
MAX_TOWER_LAYERS = 256
MAX_PATCHES = 1 << 16  # (image_size / patch_size) ** 2: tokens an image becomes


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (a ViT: `num_hidden_layers` pre-norm encoder layers over the
    `(image_size / patch_size) ** 2` patches of a square image), which of its layers'
    outputs are the image's features (`feature_layer`, Python-indexed over the embedding
    output and each layer's: -2 is the second to last layer's), whether their first
    position (CLIP's class token) is dropped (`select_strategy` "default") and the
    two-layer MLP projector.
    Each image is `image_token_id` in the prompt, repeated `tokens_per_image` times.
    Gemma 3 (`architecture` "gemma3"): the features are the last layer's output after
    `post_layernorm`, average-pooled to `mm_tokens_per_image` rows; in text an image is
    `begin_image_token_id`, its tokens and `end_image_token_id` between blank lines.
    Idefics3 / SmolVLM (`architecture` "idefics3"): each tile of an image is a run of
    `tokens_per_image` image tokens (its last layer's normed output, pixel-shuffled
    `scale_factor` patches a side, projected).
    Qwen2.5-VL (`architecture` "qwen2_5_vl"): an image of any size (its sides multiples of
    `patch_size` x `spatial_merge_size`) is a run of one image token per
    `spatial_merge_size` x `spatial_merge_size` patches, between the vision start and end
    tokens its chat template writes; the decoder's rotary positions are M-RoPE's
    (`ModelConfig.mrope_section`). `image_size` is the smallest image's side (one token);
    `tokens_per_image` the most an image takes under the processor's default pixel cap.
    Qwen3-VL (`architecture` "qwen3_vl"): the same image tokens, a tower attending over
    the whole image in every layer, with learned positions (`num_position_embeddings`, a
    square grid interpolated to the image's) besides the rotary ones; the outputs of
    `deepstack_layers` are merged too and added to the image tokens' hidden states after
    the decoder's first layers (an image token's row is the embedding, then one row per
    deepstack layer, side by side)."""

    architecture: str  # "llava" | "gemma3" | "idefics3" (SmolVLM's) | "qwen2_5_vl" | "qwen3_vl"
    tower: str  # "clip" | "siglip" | "qwen2_5_vit" | "qwen3_vit"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int
    select_strategy: str  # "default": the first position dropped; "full": kept
    projector_act: str
    projector_bias: bool
    image_token_id: int
    # the image token is a token of the vocabulary (a Hugging Face checkpoint's "<image>");
    # False (a GGUF decoder with a projector file): the id only fills the image's positions
    image_token_in_vocabulary: bool = True
    mm_tokens_per_image: int = 0  # Gemma 3: the pooled rows an image becomes
    begin_image_token_id: int | None = None  # Gemma 3's <start_of_image>
    end_image_token_id: int | None = None  # and <end_of_image>
    scale_factor: int = 0  # Idefics3: patches a side merged into one row by pixel shuffle
    # Qwen2.5-VL's tower: patches a side merged into one token, frames a patch spans (an
    # image is two copies of itself), the window (px) its windowed layers attend within,
    # the layers that attend over the whole image, the merger's output width
    spatial_merge_size: int = 0
    temporal_patch_size: int = 0
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    out_hidden_size: int = 0
    # Qwen3-VL's tower: its learned positions (a square grid) and the layers whose outputs
    # are merged for the decoder's first layers
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in VISION_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported vision-language architecture "
                                        f"{self.architecture!r}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "image_size", "patch_size", "num_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"vision_config.{name} must be a positive integer, "
                                 f"got {value!r}")
        if self.num_hidden_layers > MAX_TOWER_LAYERS:
            raise ValueError(f"vision_config.num_hidden_layers {self.num_hidden_layers} is "
                             f"beyond any vision tower's (at most {MAX_TOWER_LAYERS})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("vision_config.hidden_size is not a multiple of its "
                             "num_attention_heads")
        # the patches a side are image_size // patch_size (SigLIP-so400m: 384 // 14 = 27;
        # the convolution leaves the remainder out)
        if self.image_size < self.patch_size or self.num_patches > MAX_PATCHES:
            raise ValueError(f"vision_config: image_size {self.image_size} must hold at least "
                             f"one patch of {self.patch_size} and at most {MAX_PATCHES} "
                             f"patches")
        if self.hidden_act not in TOWER_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported vision tower activation "
                                        f"{self.hidden_act!r}")
        if self.projector_act not in PROJECTOR_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported projector activation "
                                        f"{self.projector_act!r}")
        if self.select_strategy not in ("default", "full"):
            raise UnsupportedModelError(f"unsupported vision_feature_select_strategy "
                                        f"{self.select_strategy!r}")
        if not isinstance(self.feature_layer, int) or not (
                -self.num_positions_layers <= self.feature_layer < self.num_positions_layers):
            raise UnsupportedModelError(
                f"vision_feature_layer must be one layer's index (a list of layers is not "
                f"supported), got {self.feature_layer!r}")
        if not isinstance(self.image_token_id, int) or self.image_token_id < 0:
            raise ValueError(f"image_token_id must be a token id, got {self.image_token_id!r}")
        if self.pooled:
            self._check_pooling()
        if self.merged:
            self._check_merging()
        if self.tiled:
            side = self.image_size // self.patch_size
            scale = self.scale_factor
            if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1 or side % scale:
                raise ValueError(f"scale_factor must divide the {side} patches a side, got "
                                 f"{scale!r}")

    def _check_pooling(self) -> None:
        side = self.image_size // self.patch_size
        pooled = self.mm_tokens_per_image
        per_side = int(round(pooled ** 0.5)) if isinstance(pooled, int) and pooled > 0 else 0
        if per_side * per_side != pooled or side % per_side:
            raise ValueError(f"mm_tokens_per_image must be a square whose side divides the "
                             f"{side} patches a side, got {pooled!r}")
        for name in ("begin_image_token_id", "end_image_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a token id, got {value!r}")

    def _check_merging(self) -> None:
        qwen3 = self.architecture == "qwen3_vl"
        for name in ("spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                     "num_position_embeddings" if qwen3 else "window_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"vision_config.{name} must be a positive integer, "
                                 f"got {value!r}")
        if qwen3:
            self._check_qwen3()
        elif self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"vision_config.window_size {self.window_size} is not a multiple "
                             f"of a merged patch's {self.patch_size * self.spatial_merge_size} px")
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers
                   for i in self.full_attention_layers):
            raise ValueError(f"vision_config.fullatt_block_indexes must be layer indexes, got "
                             f"{self.full_attention_layers!r}")
        if (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError("the vision tower's head size must be a multiple of 4 (its "
                             "rotary positions turn a quarter of it by row, a quarter by "
                             "column)")

    def _check_qwen3(self) -> None:
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings or side < 2:
            raise ValueError(f"vision_config.num_position_embeddings must be a square grid "
                             f"of at least 2 x 2, got {self.num_position_embeddings}")
        layers = self.deepstack_layers
        if not isinstance(layers, tuple) or len(set(layers)) != len(layers) or not all(
                isinstance(i, int) and not isinstance(i, bool)
                and 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(f"vision_config.deepstack_visual_indexes must be distinct layer "
                             f"indexes, got {layers!r}")

    @property
    def merged(self) -> bool:
        """Qwen2.5-VL's and Qwen3-VL's image side: images of any size, 2 x 2 patches to a
        token."""
        return self.architecture in ("qwen2_5_vl", "qwen3_vl")

    @property
    def row_width(self) -> int:
        """An image token's row as the tower gives it: the embedding (`out_hidden_size`
        for the merged towers) and Qwen3-VL's deepstack rows beside it."""
        return self.out_hidden_size * (1 + len(self.deepstack_layers))

    @property
    def merged_patch(self) -> int:
        """Pixels a side of one image token (Qwen2.5-VL: 28)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def pooled(self) -> bool:
        """Gemma 3's image side: pooled features, images attending within themselves."""
        return self.architecture == "gemma3"

    @property
    def tiled(self) -> bool:
        """Idefics3's image side: an image is tiles, each its own run of image tokens."""
        return self.architecture == "idefics3"

    @property
    def normed_output(self) -> bool:
        """Whether the features are the tower's last layer after `post_layernorm` (Gemma 3,
        Idefics3), not a hidden state (LLaVA)."""
        return self.pooled or self.tiled

    @property
    def images_attend_both_ways(self) -> bool:
        """Whether an image's tokens attend to each other in both directions in the
        decoder (Gemma 3), not causally: then a prefill chunk never ends inside an image."""
        return self.pooled

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions_layers(self) -> int:
        """Hidden states the tower can give: the embeddings' and each layer's output."""
        return self.num_hidden_layers + 1

    @property
    def has_class_token(self) -> bool:
        return self.tower == "clip"

    @property
    def tokens_per_image(self) -> int:
        """The feature layer's positions (the patches, CLIP's class token first), less the
        first under the "default" strategy (as transformers drops it, whatever the tower:
        a SigLIP tower, which has no class token, loses its first patch); Gemma 3's pooled
        rows."""
        if self.pooled:
            return self.mm_tokens_per_image
        if self.tiled:
            return self.num_patches // self.scale_factor ** 2
        if self.merged:
            return DEFAULT_MAX_PIXELS // self.merged_patch ** 2
        positions = self.num_patches + int(self.has_class_token)
        return positions - int(self.select_strategy == "default")

    @property
    def layers_run(self) -> int:
        """Encoder layers the features need (those after `feature_layer` are not run)."""
        return self.feature_layer % self.num_positions_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "VisionConfig":
        vision = cfg.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("vision_config must be an object")
        tower = VISION_TOWERS.get(vision.get("model_type"))
        if tower is None:
            raise UnsupportedModelError(
                f"unsupported vision tower {vision.get('model_type')!r} (supported: "
                f"{', '.join(VISION_TOWERS)})")
        image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
        default_act = "quick_gelu" if tower == "clip" else "gelu_pytorch_tanh"
        if cfg["model_type"] == "gemma3":
            return cls._gemma3(cfg, vision, tower, image_token)
        if cfg["model_type"] in ("idefics3", "smolvlm"):
            return cls._idefics3(cfg, vision, image_token)
        if cfg["model_type"] == "qwen2_5_vl":
            return cls._qwen2_5_vl(vision, image_token)
        if cfg["model_type"] == "qwen3_vl":
            return cls._qwen3_vl(vision, image_token)
        return cls(
            architecture=cfg["model_type"], tower=tower,
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 3072),
            num_hidden_layers=vision.get("num_hidden_layers", 12),
            num_attention_heads=vision.get("num_attention_heads", 12),
            image_size=vision.get("image_size", 224),
            patch_size=vision.get("patch_size", 32 if tower == "clip" else 16),
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=float(vision.get("layer_norm_eps",
                                            1e-5 if tower == "clip" else 1e-6)),
            hidden_act=vision.get("hidden_act", default_act),
            feature_layer=cfg.get("vision_feature_layer", -2),
            select_strategy=cfg.get("vision_feature_select_strategy", "default"),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_token_id=image_token if image_token is not None else 32000,
        )

    @classmethod
    def _gemma3(cls, cfg: dict[str, Any], vision: dict[str, Any], tower: str,
                image_token: Any) -> "VisionConfig":
        """Gemma 3's SigLIP tower (its defaults are transformers' Gemma3Config's:
        SigLIP-so400m at 896 px) and pooled projector."""
        if tower != "siglip":
            raise UnsupportedModelError(f"a Gemma 3 vision tower is SigLIP, not {tower}")
        return cls(
            architecture="gemma3",
            **_normed_siglip(vision, "Gemma 3", (1152, 4304, 27, 16, 896, 14)),
            image_token_id=image_token if image_token is not None else 262144,
            mm_tokens_per_image=cfg.get("mm_tokens_per_image", 256),
            begin_image_token_id=cfg.get("boi_token_id", cfg.get("boi_token_index", 255999)),
            end_image_token_id=cfg.get("eoi_token_id", cfg.get("eoi_token_index", 256000)),
        )

    @classmethod
    def _idefics3(cls, cfg: dict[str, Any], vision: dict[str, Any],
                  image_token: Any) -> "VisionConfig":
        """Idefics3's and SmolVLM's SigLIP-shaped tower (their configs' defaults) and
        pixel-shuffle projector."""
        return cls(
            architecture="idefics3",
            **_normed_siglip(vision, "an Idefics3", (1152, 3072, 12, 16, 224, 32)),
            image_token_id=image_token if image_token is not None else 128257,
            scale_factor=cfg.get("scale_factor", 2),
        )

    @classmethod
    def _qwen2_5_vl(cls, vision: dict[str, Any], image_token: Any) -> "VisionConfig":
        """Qwen2.5-VL's ViT (its config's names and defaults: the 3B/7B/72B tower)."""
        if vision.get("in_channels", vision.get("in_chans", 3)) != 3:
            raise UnsupportedModelError("a Qwen2.5-VL vision tower takes RGB images")
        patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
        full = vision.get("fullatt_block_indexes", (7, 15, 23, 31))
        return cls(
            architecture="qwen2_5_vl", tower="qwen2_5_vit",
            hidden_size=vision.get("hidden_size", 1280),
            intermediate_size=vision.get("intermediate_size", 3420),
            num_hidden_layers=vision.get("depth", vision.get("num_hidden_layers", 32)),
            num_attention_heads=vision.get("num_heads", vision.get("num_attention_heads", 16)),
            image_size=patch * merge if isinstance(patch, int) and isinstance(merge, int)
            else patch, patch_size=patch, num_channels=3, layer_norm_eps=1e-6,
            hidden_act=vision.get("hidden_act", "silu"), feature_layer=-1,
            select_strategy="full", projector_act="gelu", projector_bias=True,
            image_token_id=image_token if image_token is not None else 151655,
            spatial_merge_size=merge,
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            window_size=vision.get("window_size", 112),
            full_attention_layers=tuple(full) if isinstance(full, list | tuple) else full,
            out_hidden_size=vision.get("out_hidden_size", 3584),
        )


    @classmethod
    def _qwen3_vl(cls, vision: dict[str, Any], image_token: Any) -> "VisionConfig":
        """Qwen3-VL's ViT (its config's names and defaults: transformers'
        Qwen3VLVisionConfig, the 8B's tower)."""
        if vision.get("in_channels", 3) != 3:
            raise UnsupportedModelError("a Qwen3-VL vision tower takes RGB images")
        rope = vision.get("rope_parameters") or vision.get("rope_scaling") or {}
        if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" \
                or rope.get("rope_theta", 10000.0) != 10000.0:
            raise UnsupportedModelError(f"unsupported Qwen3-VL vision rotary parameters "
                                        f"{rope!r}")
        patch, merge = vision.get("patch_size", 16), vision.get("spatial_merge_size", 2)
        deepstack = vision.get("deepstack_visual_indexes", (8, 16, 24))
        return cls(
            architecture="qwen3_vl", tower="qwen3_vit",
            hidden_size=vision.get("hidden_size", 1152),
            intermediate_size=vision.get("intermediate_size", 4304),
            num_hidden_layers=vision.get("depth", vision.get("num_hidden_layers", 27)),
            num_attention_heads=vision.get("num_heads", vision.get("num_attention_heads", 16)),
            image_size=patch * merge if isinstance(patch, int) and isinstance(merge, int)
            else patch, patch_size=patch, num_channels=3, layer_norm_eps=1e-6,
            hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"), feature_layer=-1,
            select_strategy="full", projector_act="gelu", projector_bias=True,
            image_token_id=image_token if image_token is not None else 151655,
            spatial_merge_size=merge,
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            out_hidden_size=vision.get("out_hidden_size", 3584),
            num_position_embeddings=vision.get("num_position_embeddings", 2304),
            deepstack_layers=tuple(deepstack) if isinstance(deepstack, list | tuple)
            else deepstack,
        )


# Qwen2.5-VL's image processor's default pixel cap (an image is resized under it)
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def _normed_siglip(vision: dict[str, Any], family: str,
                   defaults: tuple[int, int, int, int, int, int]) -> dict[str, Any]:
    """A SigLIP-shaped tower read at its last layer's normed output (Gemma 3, Idefics3):
    its fields from `vision_config`, `defaults` (hidden, intermediate, layers, heads,
    image side, patch) where it says nothing."""
    if vision.get("num_channels", 3) != 3:
        raise UnsupportedModelError(f"{family} vision tower takes RGB images")
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "image_size", "patch_size")
    return {**{name: vision.get(name, default) for name, default in zip(names, defaults,
                                                                         strict=True)},
            "tower": "siglip", "num_channels": 3,
            "layer_norm_eps": float(vision.get("layer_norm_eps", 1e-6)),
            "hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh"),
            "feature_layer": -1, "select_strategy": "full",
            "projector_act": "gelu", "projector_bias": False}  # (no MLP: unused)
