"""A GGUF decoder with a projector file (`--mmproj`, as llama.cpp writes both) against
`transformers`' LLaVA on the same weights: greedy tokens equal with one and two images, a
chat's images marked <__media__>, and projector files that cannot be used refused by name."""

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from llmserve import LLM, SamplingParams
from llmserve.errors import ModelFormatError, RequestRejected, UnsupportedModelError
from llmserve.gguf_meta import open_gguf, read_metadata
from tests.gguf_writer import write_gguf, write_mmproj
from tests.models.test_llava_reference import random_image
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import randomize

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf):
    """(text GGUF, projector file, transformers' LLaVA on the same weights, image token)."""
    folder = tmp_path_factory.mktemp("llava-gguf")
    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    text = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=1024,
                                    tie_word_embeddings=True)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=3, num_attention_heads=4,
                                           image_size=28, patch_size=7)
    image_token = vocab - 1  # the reference's; the GGUF side has no image token
    llava = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token,
        tie_word_embeddings=True))
    randomize(llava)
    llava.eval()
    decoder = transformers.LlamaForCausalLM(text)
    decoder.model.load_state_dict(llava.model.language_model.state_dict())
    gguf_path = write_gguf(decoder, folder / "text.gguf", QT.F32, tokenizer)
    mmproj = write_mmproj(llava, folder / "mmproj.gguf", QT.F32)
    return gguf_path, mmproj, llava, image_token


@pytest.fixture(scope="module")
def llm(files):
    gguf_path, mmproj, _, _ = files
    return LLM(str(gguf_path), mmproj=str(mmproj), dtype="float32", kv_cache_memory="64MiB")


def assert_follows_reference(llava, image_token: int, ids: list[int],
                             image_positions: list[int], images, tokens: list[int]) -> None:
    """Our greedy `tokens` are transformers' on the prompt with its image token at the
    images' positions (`assert_greedy_follows`)."""
    ref_ids = list(ids)
    for p in image_positions:
        ref_ids[p] = image_token
    processor = CLIPImageProcessorPil(size={"shortest_edge": 28},
                                      crop_size={"height": 28, "width": 28})
    pixels = torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))
    assert_greedy_follows(llava, ref_ids, tokens, pixel_values=pixels)


@pytest.mark.parametrize("num_images", [1, 2])
def test_gguf_with_a_projector_file_matches_transformers(files, llm, num_images):
    _, _, llava, image_token = files
    images = [random_image(30 + i, 40, 50 + 9 * i) for i in range(num_images)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in the picture?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    vision = llm.engine.loaded.config.vision
    positions = [m.offset + i for m in llm.engine.input_processor.images.encode(
        llm.tokenizer, *_rendered(llm, content))[1] for i in range(m.length)]
    assert len(positions) == num_images * vision.tokens_per_image == 16 * num_images
    assert_follows_reference(llava, image_token, out.prompt_token_ids, positions, images,
                             out.outputs[0].token_ids)


def _rendered(llm, content):
    text, inputs = llm.engine.input_processor.images.render_chat(
        llm.tokenizer, [{"role": "user", "content": content}], add_generation_prompt=True)
    return text, inputs


def test_text_prompts_mark_images_as_media(llm):
    prompt = {"prompt": "Look: <__media__>\nWhat is it?",
              "multi_modal_data": {"image": random_image(3)}}
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(out.prompt_token_ids) > 16
    with pytest.raises(RequestRejected, match="in text prompts"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {
            "image": random_image(3)}}, GREEDY, use_tqdm=False)


def test_unusable_projector_files_are_refused(files, tmp_path, smollm2_gguf):
    gguf_path, mmproj, _, _ = files
    with pytest.raises(ModelFormatError, match="not a vision projector"):
        LLM(str(gguf_path), mmproj=str(smollm2_gguf), dtype="float32")
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2)).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError, match="GGUF model"):
        LLM(str(folder), mmproj=str(mmproj), dtype="float32")
