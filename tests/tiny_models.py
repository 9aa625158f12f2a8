"""Tiny random checkpoints for the reference tests: random weights (norms and biases too)
saved as a Hugging Face folder with a byte-level tokenizer (every byte one of 256 tokens),
so that an engine can load it and `transformers` runs the same weights."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights drawn large enough that a mistake shows in the logits (norms around 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.08)


def save_byte_tokenizer(folder: Path) -> None:
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")


def save_tiny(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`model` randomised and saved to `folder` with the byte tokenizer; returns it in eval
    mode (the reference)."""
    randomize(model)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return model.eval()


def save_tiny_llava(folder: Path, tower: str = "clip", image_size: int = 28,
                    patch_size: int = 7, **text: int) -> torch.nn.Module:
    """A tiny random LLaVA (a CLIP or SigLIP tower, a Llama decoder) saved with the byte
    tokenizer plus `<image>` (id 256, the image token) and a preprocessor_config.json;
    returns transformers' model (the reference)."""
    import json

    import transformers
    from tokenizers import AddedToken

    folder.mkdir(parents=True, exist_ok=True)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 num_attention_heads=4, image_size=image_size, patch_size=patch_size)
    vision = transformers.CLIPVisionConfig(**shape) if tower == "clip" else \
        transformers.SiglipVisionConfig(**shape)
    decoder = transformers.LlamaConfig(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, **text})
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=decoder, image_token_id=IMAGE_TOKEN_ID))
    save_tiny(model, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<image>", special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    processor = {"size": {"shortest_edge": image_size},
                 "crop_size": {"height": image_size, "width": image_size}} \
        if tower == "clip" else {"size": {"height": image_size, "width": image_size}}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAVA_TEMPLATE}))
    return model


# LLaVA-1.5's chat template (images first in each message, then its text)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


IMAGE_TOKEN_ID = 256  # "<image>" in save_tiny_llava's tokenizer
