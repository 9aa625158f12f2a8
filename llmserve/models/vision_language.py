"""Vision-language models: a vision tower and projector (`vision.py`) before a decoder,
whose image tokens' embeddings are the projected image features.

* LLaVA-style (LLaVA-1.5, LLaVA-NeXT without tiling, the OneVision shape with one image
  tile): a CLIP or SigLIP hidden state through an MLP before a Llama-family decoder;
* Gemma 3: SigLIP's output pooled and projected before Gemma 3's decoder, an image's
  tokens attending to each other both ways (`AttentionMetadata.image_spans`);
* Idefics3 / SmolVLM: each tile of an image through a SigLIP-shaped tower, its output
  pixel-shuffled and projected, before a Llama-family decoder;
* Qwen2.5-VL: an image of any size through its own ViT and patch merger
  (`qwen_vision.py`) before a Qwen2 decoder with M-RoPE positions (`worker/mrope.py`);
* Qwen3-VL: likewise before a Qwen3 decoder with interleaved M-RoPE, the tower's
  DeepStack rows added to the image tokens' hidden states after the decoder's first
  layers (`LlamaForCausalLM.forward`).

The decoder is the text model's class itself, so everything the text path has (the
native stack, quantized linears, LoRA, the compiled step) runs unchanged; the image side
(`VisionLanguageModel`) adds `encode_slices` (`encode_images` a slice at a time), which
the model runner runs a few slices per step beside the other requests' tokens until an
image's rows are ready, and `forward`'s `embeds`, which put the rows in place.
"""

from collections.abc import Generator

import torch

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan
from llmserve.errors import UnsupportedModelError
from llmserve.models.gemma3 import Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.qwen_vision import merged_tower
from llmserve.models.vision import VisionTower, projector_class, run_slices

# a checkpoint's prefixes (transformers 4.x and 5.x layouts) -> the model's
NAME_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    # Idefics3 / SmolVLM
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_tower."),
    ("model.connector.modality_projection.", "multi_modal_projector."),
    # Qwen2.5-VL (its merger inside the tower)
    ("model.visual.", "vision_tower."),
    ("visual.", "vision_tower."),
)
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# SigLIP's attention-pooling head: a hidden state or the normed output is read, never the
# pooled one
UNUSED_PREFIXES = ("vision_tower.head.",)


def vision_language_name(name: str) -> str:
    """A vision-language checkpoint tensor's name in this model."""
    for old, new in NAME_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class VisionLanguageModel:
    """The image side of a vision-language model, mixed in before its decoder's class.
    Not under tensor parallelism (the tower is not sharded)."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None) -> None:
        if plan is not None and plan.tp.size > 1:
            raise UnsupportedModelError("vision-language models run with "
                                        "tensor_parallel_size 1")
        super().__init__(cfg, None)
        assert cfg.vision is not None  # the registry picks these classes for vision configs
        if cfg.vision.merged:  # the tower ends in its merger: no projector after it
            self.vision_tower = merged_tower(cfg.vision)
            return
        self.vision_tower = VisionTower(cfg.vision)
        self.multi_modal_projector = projector_class(cfg.vision)(cfg.vision, cfg.hidden_size)

    @property
    def tokens_per_image(self) -> int:
        return self.config.vision.tokens_per_image

    def set_tower_dtype(self, dtype: torch.dtype) -> None:
        """Run the tower and projector in `dtype` (their inputs cast to it, their rows
        placed in the decoder's dtype)."""
        self.vision_tower.to(dtype)
        if not self.config.vision.merged:
            self.multi_modal_projector.to(dtype)

    def encode_images(self, pixel_values: torch.Tensor,
                      grid: tuple[int, int] | None = None) -> torch.Tensor:
        """(N, C, S, S) preprocessed images -> (N, tokens_per_image, hidden_size), the rows
        each image's tokens take in the decoder. Qwen2.5-VL's: one image's (1, patches,
        width) patches and its tokens' `grid` -> (1, rows x columns, hidden_size)."""
        return run_slices(self.encode_slices(pixel_values, grid))

    def encode_slices(self, pixel_values: torch.Tensor, grid: tuple[int, int] | None = None
                      ) -> Generator[None, None, torch.Tensor]:
        """`encode_images` a slice at a time (`VisionTower.slices`): the model runner runs
        a few slices per step beside the other requests' tokens."""
        if self.config.vision.merged:
            return (yield from self.vision_tower.slices(pixel_values, grid))
        features = yield from self.vision_tower.slices(pixel_values)
        if self.config.vision.select_strategy == "default":
            features = features[:, 1:]  # CLIP's class token (a SigLIP's first patch)
        return self.multi_modal_projector(features)

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor],
                     from_blocks: frozenset[str] = frozenset()) -> None:
        """The decoder's tensors as its class loads them; the tower's and the projector's
        by name (all of them, but SigLIP's unused pooling head)."""
        decoder: dict[str, torch.Tensor] = {}
        image: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            name = vision_language_name(name)
            if name.startswith(UNUSED_PREFIXES):
                continue
            (image if name.startswith(IMAGE_PREFIXES) else decoder)[name] = tensor
        own = {name: p for name, p in self.named_parameters()
               if name.startswith(IMAGE_PREFIXES)}
        missing = sorted(set(own) - set(image))
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
        for name, tensor in image.items():
            if name not in own:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != "
                                 f"{tuple(own[name].shape)}")
            own[name].copy_(tensor)
        super().load_weights(decoder, from_blocks | frozenset(own))


class LlavaForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """LLaVA: vision tower + MLP projector + Llama-family decoder."""


class Gemma3ForConditionalGeneration(VisionLanguageModel, Gemma3ForCausalLM):
    """Gemma 3 with its SigLIP tower and pooled projector."""


class Idefics3ForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """Idefics3 and SmolVLM: tiles through the tower and pixel-shuffle projector, a
    Llama-family decoder."""


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """Qwen2.5-VL: its ViT and patch merger, a Qwen2 decoder with M-RoPE."""


class Qwen3VLForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """Qwen3-VL: its ViT, patch merger and DeepStack mergers, a Qwen3 decoder with
    interleaved M-RoPE."""
