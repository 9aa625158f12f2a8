"""Gemma 3 with images against `transformers` on tiny random checkpoints (a SigLIP tower,
the pooled projector, a decoder with local and global layers): preprocessing, image
features, logits and greedy tokens with one and several images and images in several
turns, where an image's tokens attend to each other both ways (also across a local
layer's window); an image request's tokens unchanged by batching, chunking (a chunk never
ends inside an image), preemption and prefix-cache hits, on the float32 path and the
default one."""

import numpy as np
import pytest
import torch
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.engine.input_processor import RequestRejected
from llmserve.multimodal.images import to_rgb
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_llava_reference import assert_memory_counts, our_logits, random_image
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import (
    GEMMA3_BOI_ID,
    GEMMA3_EOI_ID,
    GEMMA3_IMAGE_ID,
    save_tiny_gemma3_vision,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TOKENS_PER_IMAGE = 16  # 8 x 8 patches pooled 2 x 2: longer than the local window of 8


@pytest.fixture(scope="module")
def gemma3v(tmp_path_factory):
    """(folder, transformers' model, our float32 LLM)."""
    folder = tmp_path_factory.mktemp("gemma3-vision")
    reference = save_tiny_gemma3_vision(folder, image_size=32, patch_size=4,
                                        tokens_per_image=TOKENS_PER_IMAGE).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    return folder, reference, llm


def reference_pixels(folder, images) -> torch.Tensor:
    processor = Gemma3ImageProcessorPil.from_pretrained(folder)
    return torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))


def reference_logits(reference, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    types = (torch.tensor([ids]) == GEMMA3_IMAGE_ID).long()
    with torch.inference_mode():
        return reference(input_ids=torch.tensor([ids]), pixel_values=pixels,
                         token_type_ids=types).logits[0]


def chat_ids(llm, images, text="What is in these pictures?") -> list[int]:
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": text}]
    prompts = llm.engine.input_processor.images
    rendered, inputs = prompts.render_chat(llm.tokenizer, [{"role": "user",
                                                              "content": content}])
    ids, _ = prompts.encode(llm.tokenizer, rendered, inputs)
    return ids


def test_the_folders_preprocessing_equals_transformers(gemma3v):
    folder, _, llm = gemma3v
    processor = llm.engine.input_processor.images.processor
    for image in (random_image(5), random_image(6, 64, 30), random_image(7, 90, 41, "RGBA")):
        expected = reference_pixels(folder, [image])[0]
        assert torch.equal(processor(to_rgb(image)), expected), image.size


def test_an_image_is_written_as_gemma3s_processor_writes_it(gemma3v):
    """A blank line, <start_of_image>, the image's tokens, <end_of_image>, a blank line:
    the ids transformers' Gemma 3 processor makes of the same chat."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast

    folder, _, llm = gemma3v
    images = [random_image(1), random_image(2, 50, 70)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), boi_token="<start_of_image>",
        eoi_token="<end_of_image>", image_token="<image_soft_token>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(Gemma3ImageProcessorPil.from_pretrained(folder), tokenizer,
                                image_seq_length=TOKENS_PER_IMAGE)
    text = "<start_of_turn>user\n<start_of_image>Compare<start_of_image>them.<end_of_turn>\n"
    expected = processor(images=[images], text=[text], return_tensors="pt")
    ids, placed = llm.engine.input_processor.images.encode(llm.tokenizer, text, images)
    assert ids == expected["input_ids"][0].tolist()
    assert [(p.offset, p.length) for p in placed] == [
        (i, TOKENS_PER_IMAGE) for i, t in enumerate(ids)
        if t == GEMMA3_IMAGE_ID and ids[i - 1] == GEMMA3_BOI_ID]
    assert ids.count(GEMMA3_EOI_ID) == 2


def test_image_features_equal_transformers(gemma3v):
    folder, reference, llm = gemma3v
    pixels = reference_pixels(folder, [random_image(0), random_image(1, 90, 30)])
    with torch.inference_mode():
        ours = llm.engine.loaded.model.encode_images(pixels)
        ref = reference.get_image_features(pixels).pooler_output
    diff = (ours - ref).abs().max().item()
    print(f"image features max |diff| vs transformers {diff:.2e}")
    assert ours.shape == (2, TOKENS_PER_IMAGE, 64) and diff <= 1e-5


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_reference(gemma3v, num_images):
    folder, reference, llm = gemma3v
    images = [random_image(i, 40 + 7 * i, 50) for i in range(num_images)]
    ids = chat_ids(llm, images)
    pixels = reference_pixels(folder, images)
    ours = our_logits(llm.engine.loaded.model, ids, pixels, GEMMA3_IMAGE_ID)
    ref = reference_logits(reference, ids, pixels)
    diff = (ours - ref).abs().max().item()
    print(f"{num_images} image(s): max |logit diff| over {len(ids)} positions {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_the_images_tokens_see_each_other_both_ways(gemma3v):
    """Causal attention over the image would be another model: its logits move."""
    folder, reference, llm = gemma3v
    images = [random_image(3)]
    ids = chat_ids(llm, images)
    pixels = reference_pixels(folder, images)
    with torch.inference_mode():
        causal = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    both_ways = reference_logits(reference, ids, pixels)
    assert (causal - both_ways).abs().max().item() > 100 * LOGIT_TOLERANCE


def test_greedy_matches_reference_in_a_chat_of_several_turns(gemma3v):
    folder, reference, llm = gemma3v
    first, second = random_image(5), random_image(6, 64, 30)
    chat = [
        {"role": "user", "content": [{"type": "image", "image": first},
                                     {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A noisy square."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": second}]},
    ]
    (out,) = llm.chat(chat, GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(GEMMA3_IMAGE_ID) == 2 * TOKENS_PER_IMAGE
    pixels = reference_pixels(folder, [first, second])
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, GEMMA3_IMAGE_ID,
                          pixel_values=pixels)


def image_prompt(seed: int, text: str = "What is this?") -> dict:
    return {"prompt": f"<start_of_turn>user\n<start_of_image>{text}<end_of_turn>\n"
                      "<start_of_turn>model\n",
            "multi_modal_data": {"image": random_image(seed)}}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("path", ["float32", "default"])
def test_batching_chunking_preemption_and_cache_hits_change_no_output(gemma3v, path):
    folder, _, llm = gemma3v
    if path == "default":
        llm = LLM(str(folder), kv_cache_memory="64MiB")
    loaded = llm.engine.loaded
    prompts = [image_prompt(10), "<start_of_turn>user\na text prompt beside it<end_of_turn>\n",
               image_prompt(11, "And what is this one, in more words?"),
               "<start_of_turn>user\nanother text prompt, a little longer<end_of_turn>\n"]
    alone = [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone  # batched
    # chunks of 8 tokens: each 16-token image goes whole, the text around it in 8s
    chunked = LLM.from_engine(Engine(EngineConfig(
        kv_cache_memory="64MiB", max_num_batched_tokens=8, enable_prefix_caching=False),
        loaded=loaded))
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert chunked.engine.executor.runner.encoder_cache.num_encoded == 2  # once per image
    per_token = llm.engine.kv_plan.bytes_per_token
    tight = LLM.from_engine(Engine(EngineConfig(kv_cache_memory=10 * 16 * per_token),
                                   loaded=loaded))
    assert token_ids(tight.generate(prompts * 3, GREEDY, use_tqdm=False)) == alone * 3
    assert tight.engine.scheduler.num_preemptions > 0
    cached = LLM.from_engine(Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=loaded))
    text = "What is in the picture, described at length and with care, please?"
    first = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    again = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    other = cached.generate(image_prompt(21, text), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    # the first block is text ("<start_of_turn>user\n\n\n" is 22 tokens); the second holds
    # the image's first tokens: another image's never hits
    assert other.num_cached_tokens == 16
    assert other.outputs[0].token_ids == token_ids(
        llm.generate(image_prompt(21, text), GREEDY, use_tqdm=False))[0]


def test_image_token_runs_are_checked(gemma3v):
    _, _, llm = gemma3v
    ids = [1, 2, GEMMA3_BOI_ID, GEMMA3_IMAGE_ID, GEMMA3_EOI_ID, 3]
    with pytest.raises(RequestRejected, match=f"takes {TOKENS_PER_IMAGE} image tokens"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {
            "image": random_image(0)}}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="1 image placeholder"):
        llm.generate({"prompt": "<start_of_image>hi", "multi_modal_data": {
            "image": [random_image(0), random_image(1)]}}, GREEDY, use_tqdm=False)


def test_the_memory_calculator_counts_the_tower(gemma3v):
    _, reference, llm = gemma3v
    assert_memory_counts(reference, llm.engine.loaded.config,
                         (".vision_tower.", ".multi_modal_projector."))


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, smollm2_gguf):
    """(Gemma 3 decoder GGUF, its projector file with llama.cpp's older fc names,
    transformers' model on the same weights): the vocabulary is smollm2's plus Gemma 3's
    three image tokens (control tokens, as Gemma 3's GGUF files mark them)."""
    import transformers
    from gguf import GGMLQuantizationType as QT

    from llmserve.gguf_meta import open_gguf, read_metadata
    from tests.gguf_writer import with_control_tokens, write_gguf, write_mmproj
    from tests.tiny_models import randomize

    folder = tmp_path_factory.mktemp("gemma3-gguf")
    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")
                 and k != "tokenizer.chat_template"}
    tokenizer, boi = with_control_tokens(tokenizer, [
        "<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    eoi, image = boi + 1, boi + 2
    tokens = tokenizer["tokenizer.ggml.tokens"][:boi]
    tokenizer["tokenizer.chat_template"] = (
        "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + "
        "'<end_of_turn>\\n' }}{% endfor %}{{ '<start_of_turn>model\\n' }}")
    # six layers: llama.cpp's Gemma 3 has every sixth layer global (a GGUF names no other)
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=len(tokens) + 3,
        max_position_embeddings=1024, sliding_window=8, query_pre_attn_scalar=32)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=3, num_attention_heads=4,
                                             image_size=32, patch_size=4)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image))
    model.config._attn_implementation = "eager"
    randomize(model)
    with torch.no_grad():  # the projection as the file holds it (F16, as llama.cpp writes it)
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(projection.half().float())
    model.eval()
    decoder = transformers.Gemma3ForCausalLM(text)
    decoder.model.load_state_dict(model.model.language_model.state_dict())
    decoder.lm_head.weight = decoder.model.embed_tokens.weight
    gguf_path = write_gguf(decoder, folder / "text.gguf", QT.F32, tokenizer)
    mmproj = write_mmproj(model, folder / "mmproj.gguf", QT.F32, legacy_fc_names=True)
    return gguf_path, mmproj, model, image


@pytest.mark.parametrize("num_images", [1, 2])
def test_gguf_with_a_gemma3_projector_file_matches_transformers(gemma3_gguf, num_images):
    gguf_path, mmproj, reference, image_token = gemma3_gguf
    llm = LLM(str(gguf_path), mmproj=str(mmproj), dtype="float32", kv_cache_memory="64MiB")
    vision = llm.engine.loaded.config.vision
    assert (vision.image_token_id, vision.tokens_per_image) == (image_token, TOKENS_PER_IMAGE)
    images = [random_image(40 + i, 40, 50 + 9 * i) for i in range(num_images)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in the picture?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(image_token) == num_images * TOKENS_PER_IMAGE
    processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    pixels = torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, image_token,
                          pixel_values=pixels)


def test_a_gemma3_projector_needs_a_gemma3_decoder(gemma3_gguf, smollm2_gguf):
    from llmserve.errors import ModelFormatError

    _, mmproj, _, _ = gemma3_gguf
    with pytest.raises(ModelFormatError, match="is a Gemma 3 projector"):
        LLM(str(smollm2_gguf), mmproj=str(mmproj), dtype="float32")
