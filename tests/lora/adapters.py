"""Tiny base checkpoints and PEFT LoRA adapters on them, made in the tests: random weights
(B too: PEFT starts it at zero, which would test nothing), saved as PEFT saves them."""

from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from llmserve import LoRARequest
from tests.tiny_models import save_tiny

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_folder(folder: Path) -> transformers.PreTrainedModel:
    return save_tiny(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)), folder)


def make_adapter(base: transformers.PreTrainedModel, folder: Path, seed: int, rank: int = 8,
                 targets: list[str] = ALL_LINEARS, rslora: bool = False) -> PeftModel:
    """A LoRA on `base` (a fresh copy) with random A and B, saved to `folder`; returns the
    PEFT model (the reference)."""
    copy = transformers.LlamaForCausalLM(base.config)
    copy.load_state_dict(base.state_dict())
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                        use_rslora=rslora)
    model = get_peft_model(copy, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
    model.save_pretrained(folder)
    return model.eval()


def lora(folder: Path, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(folder))
