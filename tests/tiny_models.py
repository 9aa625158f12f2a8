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


# "<start_of_image>", "<end_of_image>", "<image_soft_token>" in save_tiny_gemma3_vision's
# tokenizer
GEMMA3_BOI_ID, GEMMA3_EOI_ID, GEMMA3_IMAGE_ID = 256, 257, 258


def save_tiny_gemma3_vision(folder: Path, image_size: int = 28, patch_size: int = 7,
                            tokens_per_image: int = 4, **text) -> torch.nn.Module:
    """A tiny random Gemma 3 vision-language model (a SigLIP tower, the pooled projector,
    Gemma 3's decoder with local and global layers) saved with the byte tokenizer plus
    Gemma 3's three image tokens, a preprocessor_config.json and Gemma 3's chat template;
    returns transformers' model (the reference)."""
    import json

    import transformers
    from tokenizers import AddedToken

    folder.mkdir(parents=True, exist_ok=True)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=image_size, patch_size=patch_size, vision_use_head=False)
    decoder = transformers.Gemma3TextConfig(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 320, "max_position_embeddings": 1024, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "query_pre_attn_scalar": 24, "rope_theta": 50000.0, "rope_local_base_freq": 1000.0,
        **text})
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        vision_config=vision, text_config=decoder, mm_tokens_per_image=tokens_per_image,
        boi_token_index=GEMMA3_BOI_ID, eoi_token_index=GEMMA3_EOI_ID,
        image_token_index=GEMMA3_IMAGE_ID))
    model.config._attn_implementation = "eager"
    save_tiny(model, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (
        "<start_of_image>", "<end_of_image>", "<image_soft_token>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "resample": 2,
        "size": {"height": image_size, "width": image_size}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": GEMMA3_TEMPLATE, "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}))
    return model


# Gemma 3's chat template, its image parts written as <start_of_image>
GEMMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


# save_tiny_idefics3's tokenizer: "<image>", "<fake_token_around_image>", "<global-img>",
# "<end_of_utterance>", then "<row_1_col_1>" ... "<row_6_col_6>"
IDEFICS3_IMAGE_ID, IDEFICS3_FAKE_ID, IDEFICS3_GLOBAL_ID, IDEFICS3_END_ID = 256, 257, 258, 259


def save_tiny_idefics3(folder: Path, image_size: int = 32, patch_size: int = 4,
                       scale_factor: int = 2, longest_edge: int = 64,
                       model_type: str = "smolvlm") -> torch.nn.Module:
    """A tiny random SmolVLM (or Idefics3: `model_type`): a SigLIP-shaped tower taking
    `image_size` tiles, the pixel-shuffle projector, a Llama decoder; saved with the byte
    tokenizer plus the image, tile and row/column tokens, a preprocessor_config.json that
    splits images of up to `longest_edge` px into tiles, and SmolVLM's chat template;
    returns transformers' model (the reference)."""
    import json

    import transformers
    from tokenizers import AddedToken

    folder.mkdir(parents=True, exist_ok=True)
    idefics3 = model_type == "idefics3"
    vision_class = transformers.Idefics3VisionConfig if idefics3 else \
        transformers.SmolVLMVisionConfig
    vision = vision_class(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, image_size=image_size, patch_size=patch_size)
    decoder = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    config_class = transformers.Idefics3Config if idefics3 else transformers.SmolVLMConfig
    model_class = transformers.Idefics3ForConditionalGeneration if idefics3 else \
        transformers.SmolVLMForConditionalGeneration
    model = model_class(config_class(vision_config=vision, text_config=decoder,
                                     scale_factor=scale_factor,
                                     image_token_id=IDEFICS3_IMAGE_ID))
    save_tiny(model, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (
        "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")])
    tokenizer.add_tokens([AddedToken(f"<row_{r}_col_{c}>") for r in range(1, 7)
                          for c in range(1, 7)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SmolVLMImageProcessor" if not idefics3 else
        "Idefics3ImageProcessor", "do_image_splitting": True, "resample": 1,
        "size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": image_size},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": SMOLVLM_TEMPLATE, "eos_token": "<end_of_utterance>"}))
    return model


# SmolVLM's chat template
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")


# save_tiny_qwen2_5_vl's tokenizer: the image, video, vision start and end tokens, then
# Qwen's turn markers
QWEN_IMAGE_ID, QWEN_VIDEO_ID, QWEN_VISION_START_ID, QWEN_VISION_END_ID = 256, 257, 258, 259


def save_tiny_qwen2_5_vl(folder: Path, patch_size: int = 4, window_size: int = 16,
                         min_pixels: int = 16 * 16, max_pixels: int = 64 * 64,
                         **text) -> torch.nn.Module:
    """A tiny random Qwen2.5-VL: its ViT (patches of `patch_size` px, 2 x 2 merged into a
    token, windows of `window_size` px, layers 1 and 3 of 4 over the whole image), a Qwen2
    decoder with M-RoPE; saved with the byte tokenizer plus Qwen's image and turn tokens,
    a preprocessor_config.json (images resized to `min_pixels` .. `max_pixels`) and
    Qwen2.5-VL's chat template; returns transformers' model (the reference)."""

    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4,
                  patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=window_size, fullatt_block_indexes=[1, 3], out_hidden_size=64,
                  hidden_act="silu")
    decoder = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "bos_token_id": None, "eos_token_id": 261,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [2, 3, 3]}, **text}
    torch.manual_seed(0)  # the same random weights whatever ran before in this process
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=decoder, image_token_id=QWEN_IMAGE_ID,
        video_token_id=QWEN_VIDEO_ID, vision_start_token_id=QWEN_VISION_START_ID,
        vision_end_token_id=QWEN_VISION_END_ID))
    return _save_qwen_vl(model, folder, {
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": patch_size})


def save_tiny_qwen3_vl(folder: Path, patch_size: int = 4, min_pixels: int = 16 * 16,
                       max_pixels: int = 64 * 64, **text) -> torch.nn.Module:
    """A tiny random Qwen3-VL: its ViT (patches of `patch_size` px, 2 x 2 merged into a
    token, learned positions on a 4 x 4 grid, DeepStack from layers 0 and 2 of 4), a Qwen3
    decoder (3 layers) with interleaved M-RoPE; saved like `save_tiny_qwen2_5_vl`, its
    images normalised to [-1, 1] as Qwen3-VL's are; returns transformers' model."""

    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4,
                  patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    decoder = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "max_position_embeddings": 1024, "bos_token_id": None,
               "eos_token_id": 261, "rope_parameters": {
                   "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                   "mrope_interleaved": True}, **text}
    torch.manual_seed(0)  # the same random weights whatever ran before in this process
    model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        vision_config=vision, text_config=decoder, image_token_id=QWEN_IMAGE_ID,
        video_token_id=QWEN_VIDEO_ID, vision_start_token_id=QWEN_VISION_START_ID,
        vision_end_token_id=QWEN_VISION_END_ID))
    return _save_qwen_vl(model, folder, {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})


def _save_qwen_vl(model: torch.nn.Module, folder: Path, preprocessor: dict
                  ) -> torch.nn.Module:
    """A Qwen-VL `model` saved (randomised) with the byte tokenizer plus Qwen's image and
    turn tokens, a preprocessor_config.json (`preprocessor`'s bounds, patches and
    normalisation; 2 frames, 2 x 2 merged) and Qwen's chat template."""
    import json

    from tokenizers import AddedToken

    model.config._attn_implementation = "eager"
    save_tiny(model, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
        "<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "temporal_patch_size": 2,
        "merge_size": 2, **preprocessor}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN2_5_VL_TEMPLATE, "eos_token": "<|im_end|>"}))
    return model


# Qwen2.5-VL's chat template (its image parts as the vision start, image pad and end tokens)
QWEN2_5_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
