"""A vision-language model's image side (`VisionConfig`): its vision tower, the projector
into the decoder's embedding space and the image token, read from a Hugging Face
config.json (LLaVA: `vision_config` beside `text_config`)."""

from dataclasses import dataclass
from typing import Any

from llmserve.errors import UnsupportedModelError

# `vision_config.model_type` -> the tower's family: CLIP (a class token, a LayerNorm before
# the encoder) or SigLIP (neither; a biased patch embedding)
VISION_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
# vision-language `model_type`s (the decoder is `text_config`'s, run by `models/llama.py`)
VISION_ARCHITECTURES = ("llava",)
TOWER_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
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
    Each image is `image_token_id` in the prompt, repeated `tokens_per_image` times."""

    architecture: str  # "llava"
    tower: str  # "clip" | "siglip"
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

    def __post_init__(self) -> None:
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
        a SigLIP tower, which has no class token, loses its first patch)."""
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
