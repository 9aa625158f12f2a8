"""Model classes by architecture: the one place that maps a config to an `nn.Module`."""

from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.errors import UnsupportedModelError
from llmserve.models.gemma3 import Gemma3ForCausalLM
from llmserve.models.llama import LlamaForCausalLM
from llmserve.models.vision_language import (
    Gemma3ForConditionalGeneration,
    Idefics3ForConditionalGeneration,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,  # fused qkv / gate_up as the checkpoint stores them
    "gemma2": Gemma3ForCausalLM,  # Gemma 3's layers without q/k norms, one rotary base
    "gemma3": Gemma3ForCausalLM,
    # mixtures of experts: the Llama layers with `models/moe.py`'s MLP
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM,
}

VISION_LANGUAGE_CLASSES: dict[str, type[nn.Module]] = {
    "llava": LlavaForConditionalGeneration,
    "gemma3": Gemma3ForConditionalGeneration,
    "idefics3": Idefics3ForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    if config.vision is not None:  # a vision tower before the decoder the config names
        return VISION_LANGUAGE_CLASSES[config.vision.architecture]
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported model architecture {config.architecture!r}"
        ) from None
