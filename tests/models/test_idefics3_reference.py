"""Idefics3 and SmolVLM against `transformers` on tiny random checkpoints (a SigLIP-shaped
tower taking tiles, the pixel-shuffle projector, a Llama decoder): the tiling and pixel
values, the prompt as their processor writes it, image features, logits and greedy tokens
with one and several images (of one tile and of several) and images in several turns;
an image request's tokens unchanged by batching, chunking across its tiles, preemption
and prefix-cache hits, on the float32 path and the default one."""

import numpy as np
import pytest
import torch
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.engine.input_processor import RequestRejected
from llmserve.multimodal.images import to_rgb
from llmserve.multimodal.processors import TiledImage, TiledImageProcessor
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_llava_reference import assert_memory_counts, our_logits, random_image
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import IDEFICS3_IMAGE_ID, save_tiny_idefics3

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TOKENS_PER_TILE = 16  # 8 x 8 patches, pixel-shuffled 2 x 2


@pytest.fixture(scope="module", params=["smolvlm", "idefics3"])
def idefics3(request, tmp_path_factory):
    """(folder, transformers' model, our float32 LLM) for each model type."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_idefics3(folder, model_type=request.param).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    return folder, reference, llm


@pytest.fixture(scope="module")
def smolvlm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smolvlm-invariance")
    save_tiny_idefics3(folder)
    return folder


def reference_processor(folder) -> Idefics3ImageProcessorPil:
    return Idefics3ImageProcessorPil.from_pretrained(folder)


def reference_pixels(folder, images) -> torch.Tensor:
    """(1, tiles of all the images, 3, S, S) as transformers' processor makes them."""
    out = reference_processor(folder)([images], return_tensors="np")
    return torch.from_numpy(np.asarray(out["pixel_values"]))


@pytest.mark.parametrize("edge,tile", [(2048, 512), (1536, 384), (1456, 364)])
def test_tiles_equal_transformers_at_real_sizes(edge, tile):
    """SmolVLM's 2048/512 and 1536/384, Idefics3's 4 x 364: the tiles, their count and
    order and every pixel, for landscape, portrait, small, transparent and grey images."""
    from llmserve.config.vision import VisionConfig

    ref = Idefics3ImageProcessorPil(size={"longest_edge": edge},
                                    max_image_size={"longest_edge": tile})
    vision = VisionConfig("idefics3", "siglip", 32, 64, 2, 4, tile, 16 if tile != 364 else 14,
                          3, 1e-6, "gelu_pytorch_tanh", -1, "full", "gelu", False, 5,
                          scale_factor=2 if tile != 384 else 4)
    ours = TiledImageProcessor.from_config(ref.to_dict(), vision)
    images = [random_image(0, 480, 640), random_image(1, 333, 200), random_image(2, 20, 21),
              random_image(3, 60, 90, "RGBA"), random_image(4, 1100, 700, "L"),
              random_image(5, 512, 512)]
    for image in images:
        out = ref([[image]], return_tensors="np", return_row_col_info=True)
        expected = torch.from_numpy(np.asarray(out["pixel_values"][0]))
        tiles, rows, cols = ours.tiles(to_rgb(image))
        assert (rows, cols) == (out["rows"][0][0], out["cols"][0][0]), image.size
        assert torch.equal(torch.stack(tiles), expected), image.size


def chat_ids(llm, images, text="What is in these pictures?") -> list[int]:
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": text}]
    prompts = llm.engine.input_processor.images
    rendered, inputs = prompts.render_chat(llm.tokenizer, [{"role": "user",
                                                              "content": content}])
    ids, _ = prompts.encode(llm.tokenizer, rendered, inputs)
    return ids


def test_an_image_is_written_as_the_processor_writes_it(idefics3):
    """Tiles and the whole image, row and column tags, line breaks: the ids transformers'
    processor makes of the same text and images."""
    from transformers import Idefics3Processor, PreTrainedTokenizerFast

    folder, _, llm = idefics3
    images = [random_image(1, 40, 90), random_image(2, 20, 20), random_image(3, 70, 50)]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    processor = Idefics3Processor(reference_processor(folder), tokenizer,
                                  image_seq_len=TOKENS_PER_TILE)
    text = "User:<image>Compare<image> and <image>.<end_of_utterance>\nAssistant:"
    expected = processor(images=[images], text=[text], return_tensors="pt")
    ids, placed = llm.engine.input_processor.images.encode(llm.tokenizer, text, images)
    assert ids == expected["input_ids"][0].tolist()
    tiles = [t for image in images for t in
             llm.engine.input_processor.images.processor.image_input(image).tiles]
    assert len(placed) == len(tiles) == expected["pixel_values"].shape[1] == 3 + 5 + 5
    assert [p.hash for p in placed] == [t.hash for t in tiles]


def test_image_features_equal_transformers(idefics3):
    folder, reference, llm = idefics3
    pixels = reference_pixels(folder, [random_image(0), random_image(1, 90, 30)])
    with torch.inference_mode():
        ours = llm.engine.loaded.model.encode_images(pixels[0])
        ref = torch.stack(list(reference.get_image_features(pixels).pooler_output))
    diff = (ours.reshape(-1, 64) - ref.reshape(-1, 64)).abs().max().item()
    print(f"image features max |diff| vs transformers {diff:.2e}")
    assert ours.shape == (pixels.shape[1], TOKENS_PER_TILE, 64) and diff <= 1e-5


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_reference(idefics3, num_images):
    folder, reference, llm = idefics3
    images = [random_image(i, 40 + 7 * i, 50 + 20 * i) for i in range(num_images)]
    ids = chat_ids(llm, images)
    pixels = reference_pixels(folder, images)
    ours = our_logits(llm.engine.loaded.model, ids, pixels[0], IDEFICS3_IMAGE_ID)
    with torch.inference_mode():
        ref = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{num_images} image(s), {pixels.shape[1]} tiles: max |logit diff| over {len(ids)} "
          f"positions {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_reference_in_a_chat_of_several_turns(idefics3):
    folder, reference, llm = idefics3
    first, second = random_image(5, 64, 40), random_image(6, 30, 30)
    chat = [
        {"role": "user", "content": [{"type": "image", "image": first},
                                     {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A noisy square."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": second}]},
    ]
    (out,) = llm.chat(chat, GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    pixels = reference_pixels(folder, [first, second])
    assert ids.count(IDEFICS3_IMAGE_ID) == pixels.shape[1] * TOKENS_PER_TILE
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, pixel_values=pixels)


def image_prompt(seed: int, text: str = "What is this?", size=(40, 70)) -> dict:
    return {"prompt": f"<|im_start|>User:<image>{text}<end_of_utterance>\nAssistant:",
            "multi_modal_data": {"image": random_image(seed, *size)}}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("path", ["float32", "default"])
def test_batching_chunking_preemption_and_cache_hits_change_no_output(smolvlm_folder, path):
    llm = LLM(str(smolvlm_folder), dtype="float32" if path == "float32" else "auto",
              kv_cache_memory="64MiB")
    loaded = llm.engine.loaded
    prompts = [image_prompt(10), "<|im_start|>User: a text prompt beside it\nAssistant:",
               image_prompt(11, "And what is this one, in more words?", (30, 30)),
               "<|im_start|>User: another text prompt, a little longer\nAssistant:"]
    alone = [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone  # batched
    # chunks of 8 tokens: each 16-token tile split across two steps
    chunked = LLM.from_engine(Engine(EngineConfig(
        kv_cache_memory="64MiB", max_num_batched_tokens=8, enable_prefix_caching=False),
        loaded=loaded))
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert chunked.engine.executor.runner.encoder_cache.num_encoded == 5 + 5  # tile by tile
    per_token = llm.engine.kv_plan.bytes_per_token
    tight = LLM.from_engine(Engine(EngineConfig(kv_cache_memory=14 * 16 * per_token),
                                   loaded=loaded))
    assert token_ids(tight.generate(prompts * 3, GREEDY, use_tqdm=False)) == alone * 3
    assert tight.engine.scheduler.num_preemptions > 0
    cached = LLM.from_engine(Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=loaded))
    text = "What is in the picture, described at length and with care, please?"
    first = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    again = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    other = cached.generate(image_prompt(21, text), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    assert other.num_cached_tokens <= 32  # the first tile's tokens start in the third block
    assert other.outputs[0].token_ids == token_ids(
        llm.generate(image_prompt(21, text), GREEDY, use_tqdm=False))[0]


def test_tile_runs_are_checked(idefics3):
    _, _, llm = idefics3
    image = random_image(0, 40, 70)  # 2 x 2 tiles and the whole image: five runs
    ids = [1, 2] + [IDEFICS3_IMAGE_ID] * TOKENS_PER_TILE + [3]
    with pytest.raises(RequestRejected, match="1 image placeholder.* of 5 tiles"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                     GREEDY, use_tqdm=False)
    tiled = llm.engine.input_processor.images.processor.image_input(image)
    assert isinstance(tiled, TiledImage) and (tiled.rows, tiled.cols) == (2, 2)
    runs = ([IDEFICS3_IMAGE_ID] * TOKENS_PER_TILE + [7]) * 5
    (out,) = llm.generate({"prompt_token_ids": [1] + runs, "multi_modal_data": {
        "image": image}}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12


def test_the_memory_calculator_counts_the_tower(idefics3):
    _, reference, llm = idefics3
    assert_memory_counts(reference, llm.engine.loaded.config, (".vision_model.", ".connector."))


@pytest.fixture(scope="module")
def smolvlm_gguf(tmp_path_factory, smollm2_gguf):
    """(Llama decoder GGUF, its SmolVLM projector file, transformers' SmolVLM on the same
    weights, the image token): smollm2's vocabulary plus SmolVLM's image tokens (control
    tokens, as SmolVLM's GGUF files mark them)."""
    import transformers
    from gguf import GGMLQuantizationType as QT

    from llmserve.gguf_meta import open_gguf, read_metadata
    from tests.gguf_writer import with_control_tokens, write_gguf, write_mmproj
    from tests.tiny_models import randomize

    folder = tmp_path_factory.mktemp("smolvlm-gguf")
    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokenizer, image = with_control_tokens(tokenizer, [
        "<image>", "<fake_token_around_image>", "<global-img>"])
    tokens = tokenizer["tokenizer.ggml.tokens"][:image]
    text = transformers.LlamaConfig(vocab_size=len(tokens) + 3, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=2048, tie_word_embeddings=True)
    vision = transformers.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=3, num_attention_heads=4,
                                              image_size=32, patch_size=4)
    model = transformers.SmolVLMForConditionalGeneration(transformers.SmolVLMConfig(
        vision_config=vision, text_config=text, scale_factor=2, image_token_id=image,
        tie_word_embeddings=True))
    randomize(model)
    model.eval()
    decoder = transformers.LlamaForCausalLM(text)
    decoder.model.load_state_dict(model.model.text_model.state_dict())
    gguf_path = write_gguf(decoder, folder / "text.gguf", QT.F32, tokenizer)
    mmproj = write_mmproj(model, folder / "mmproj.gguf", QT.F32, preproc_image_size=64)
    return gguf_path, mmproj, model, image


def test_gguf_with_a_smolvlm_projector_file_matches_transformers(smolvlm_gguf):
    gguf_path, mmproj, reference, image_token = smolvlm_gguf
    llm = LLM(str(gguf_path), mmproj=str(mmproj), dtype="float32", kv_cache_memory="64MiB")
    images = [random_image(40, 40, 50), random_image(41, 20, 20)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in the pictures?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                          max_image_size={"longest_edge": 32})
    pixels = torch.from_numpy(np.asarray(processor([images], return_tensors="np")[
        "pixel_values"]))
    assert ids.count(image_token) == pixels.shape[1] * TOKENS_PER_TILE == 10 * TOKENS_PER_TILE
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, pixel_values=pixels)


def test_the_default_path_runs_the_tower_in_bfloat16_on_amx(smolvlm_folder, monkeypatch):
    """A quantized model's tower runs in bfloat16 only where torch multiplies it on AMX
    tiles (4x float32 there; slower than float32 with AVX512-BF16 alone); float32 on the
    exact path (a float checkpoint's default). The rows stay within 1.2 % of float32's (a
    SigLIP-base image of 17 tiles, measured: README)."""
    from llmserve.loader import model_loader
    from llmserve.loader.model_loader import fast_bf16_matmul

    def tower_dtype(llm):
        return llm.engine.loaded.model.vision_tower.embeddings.patch_embedding.weight.dtype

    default = LLM(str(smolvlm_folder), quantization="int8", kv_cache_memory="64MiB")
    assert tower_dtype(default) == (torch.bfloat16 if fast_bf16_matmul() else torch.float32)
    exact = LLM(str(smolvlm_folder), dtype="float32", kv_cache_memory="64MiB")
    assert tower_dtype(exact) == torch.float32
    image = random_image(3, 40, 50)
    pixels = exact.engine.input_processor.images.processor(to_rgb(image))
    with torch.inference_mode():
        ours = default.engine.loaded.model.encode_images(pixels[:1]).float()
        ref = exact.engine.loaded.model.encode_images(pixels[:1])
    assert ((ours - ref).norm() / ref.norm()).item() < 0.02
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not model_loader.fast_bf16_matmul()


def test_llmserve_memory_says_what_a_tile_costs(smolvlm_folder):
    from llmserve.entrypoints.cli.memory_report import memory_report

    report = memory_report(str(smolvlm_folder), 1, 256, "float32", None, "64MiB", 16)
    assert f"each image takes {TOKENS_PER_TILE} tokens a tile (a tile of 32 px" in report
