"""LLaVA-style vision-language models against `transformers` on tiny random checkpoints (a
CLIP and a SigLIP tower before a Llama decoder): preprocessing equal to transformers' PIL
processors, image features, logits and greedy tokens with one and several images and
images in several turns; and an image request's tokens unchanged by batching, chunking
across its image, preemption and prefix-cache hits, each image encoded once."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.config.vision import VisionConfig
from llmserve.engine.engine import Engine
from llmserve.engine.input_processor import RequestRejected
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.models import vision
from llmserve.multimodal.images import ImageError, to_rgb
from llmserve.multimodal.processors import ImageProcessor
from llmserve.worker import model_runner
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import IMAGE_TOKEN_ID, save_tiny_llava

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROCESSORS = {"clip": CLIPImageProcessorPil, "siglip": SiglipImageProcessorPil}


def random_image(seed: int, height: int = 40, width: int = 50, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    shape = (height, width) if channels == 1 else (height, width, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, tmp_path_factory):
    """(tower, folder, transformers' model, our float32 LLM) for one tower."""
    folder = tmp_path_factory.mktemp(f"llava-{request.param}")
    # SigLIP's side is no multiple of its patch (as so400m's 384 of 14): the rest is unread
    side = 28 if request.param == "clip" else 30
    reference = save_tiny_llava(folder, request.param, image_size=side).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    return request.param, folder, reference, llm


def reference_pixels(tower: str, folder, images) -> torch.Tensor:
    processor = PROCESSORS[tower].from_pretrained(folder)
    return torch.from_numpy(np.asarray(processor(images, return_tensors="np")["pixel_values"]))


def our_logits(model, ids: list[int], pixels: torch.Tensor,
               image_token_id: int = IMAGE_TOKEN_ID) -> torch.Tensor:
    """Logits at every position of one prompt through the paged path, its image tokens
    taking the images' rows in order (each image's tokens attending to each other both
    ways where the model's do)."""
    cfg = model.config
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    rows = model.encode_images(pixels).reshape(-1, cfg.hidden_size)
    block_size, n = 16, len(ids)
    kv = KVCache.allocate(cfg.num_hidden_layers, -(-n // block_size), block_size,
                          cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    meta = AttentionMetadata.build([n], [0], [list(range(-(-n // block_size)))], block_size,
                                   backend=attention_backend(torch.device("cpu")))
    if cfg.vision.images_attend_both_ways:
        for start in (p for p in positions if p - 1 not in positions):
            meta.image_spans.append((0, start, start + cfg.vision.tokens_per_image))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), kv, meta,
                       embeds=(torch.tensor(positions), rows))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("tower,side", [("clip", 336), ("siglip", 384)])
def test_preprocessing_equals_transformers(tower, side):
    """Pixel values bit-equal to transformers' PIL processor at a real model's size, for
    landscape, portrait, tiny, transparent and grey images."""
    ref = PROCESSORS[tower](**({"size": {"shortest_edge": side},
                                "crop_size": {"height": side, "width": side}}
                               if tower == "clip" else {"size": {"height": side, "width": side}}))
    vision = VisionConfig("llava", tower, 32, 64, 2, 4, side, 14 if tower == "clip" else 16,
                          3, 1e-5, "gelu", -2, "default", "gelu", True, 5)
    ours = ImageProcessor.from_config(ref.to_dict(), vision)
    images = [random_image(0, 480, 640), random_image(1, 333, 200), random_image(2, 20, 21),
              random_image(3, 60, 90, "RGBA"), random_image(4, 70, 40, "L")]
    for image in images:
        expected = np.asarray(ref(image, return_tensors="np")["pixel_values"][0])
        assert torch.equal(ours(to_rgb(image)), torch.from_numpy(expected)), image.size


def test_the_folders_preprocessing_equals_transformers(llava):
    """What the engine runs for the folder (its preprocessor_config.json, defaults filled as
    transformers fills them) gives transformers' pixel values."""
    tower, folder, _, llm = llava
    processor = llm.engine.input_processor.images.processor
    for image in (random_image(5), random_image(6, 64, 30), random_image(7, 90, 41, "RGBA")):
        expected = reference_pixels(tower, folder, [image])[0]
        assert torch.equal(processor(to_rgb(image)), expected), image.size


def test_image_features_equal_transformers(llava):
    tower, folder, reference, llm = llava
    pixels = reference_pixels(tower, folder, [random_image(0), random_image(1, 90, 30)])
    with torch.inference_mode():
        ours = llm.engine.loaded.model.encode_images(pixels)
        ref = reference.get_image_features(pixels, vision_feature_layer=-2,
                                           vision_feature_select_strategy="default")
    ref = torch.stack(list(ref.pooler_output))
    diff = (ours - ref).abs().max().item()
    print(f"{tower}: image features max |diff| vs transformers {diff:.2e}")
    assert ours.shape == ref.shape and diff <= 1e-5


def test_image_features_sliced_by_rows_equal_transformers(llava, monkeypatch):
    """Each layer's attention and MLP a few patches at a time, as an image of thousands of
    patches runs them beside other requests (`vision.SLICE_ROWS`)."""
    tower, folder, reference, llm = llava
    monkeypatch.setattr(vision, "SLICE_ROWS", 5)
    pixels = reference_pixels(tower, folder, [random_image(2)])
    with torch.inference_mode():
        ours = llm.engine.loaded.model.encode_images(pixels)
        ref = reference.get_image_features(pixels, vision_feature_layer=-2,
                                           vision_feature_select_strategy="default")
    assert (ours - torch.stack(list(ref.pooler_output))).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_reference(llava, num_images):
    tower, folder, reference, llm = llava
    images = [random_image(i, 40 + 7 * i, 50) for i in range(num_images)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in these pictures?"}]
    text, _ = llm.engine.input_processor.images.render_chat(
        llm.tokenizer, [{"role": "user", "content": content}])
    short = llm.tokenizer.encode(text, add_special_tokens=False)
    ids, _ = llm.engine.input_processor.images.place(short, images)
    pixels = reference_pixels(tower, folder, images)
    ours = our_logits(llm.engine.loaded.model, ids, pixels)
    with torch.inference_mode():
        ref = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{tower}, {num_images} image(s): max |logit diff| over {len(ids)} positions "
          f"{diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_reference_in_a_chat_of_several_turns(llava):
    """Images in two user turns and an assistant turn between: our chat's greedy tokens
    are transformers' on the same ids and pixels (`assert_greedy_follows`)."""
    tower, folder, reference, llm = llava
    first, second = random_image(5), random_image(6, 64, 30)
    chat = [
        {"role": "user", "content": [{"type": "image", "image": first},
                                     {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A noisy square."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": second}]},
    ]
    (out,) = llm.chat(chat, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == 2 * (
        llm.engine.loaded.config.vision.tokens_per_image)
    pixels = reference_pixels(tower, folder, [first, second])
    assert_greedy_follows(reference, out.prompt_token_ids, out.outputs[0].token_ids,
                          pixel_values=pixels)


def image_prompt(seed: int, text: str = "What is this?") -> dict:
    return {"prompt": f"USER: <image>\n{text} ASSISTANT:",
            "multi_modal_data": {"image": random_image(seed)}}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batching_chunking_preemption_and_cache_hits_change_no_output(llava):
    _, _, _, llm = llava
    loaded = llm.engine.loaded
    prompts = [image_prompt(10), "USER: a text prompt beside it ASSISTANT:",
               image_prompt(11, "And what is this one, in more words?"),
               "USER: another text prompt, a little longer ASSISTANT:"]
    alone = [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone  # batched
    # chunks of 8 tokens: each image's 15-16 tokens span two or three steps
    chunked = LLM.from_engine(Engine(EngineConfig(
        kv_cache_memory="64MiB", max_num_batched_tokens=8, enable_prefix_caching=False),
        loaded=loaded))
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert chunked.engine.executor.runner.encoder_cache.num_encoded == 2  # once per image
    # preempted and resumed: too few blocks for all at once
    per_token = llm.engine.kv_plan.bytes_per_token
    tight = LLM.from_engine(Engine(EngineConfig(kv_cache_memory=6 * 16 * per_token),
                                   loaded=loaded))
    many = prompts * 3
    assert token_ids(tight.generate(many, GREEDY, use_tqdm=False)) == alone * 3
    assert tight.engine.scheduler.num_preemptions > 0


def test_an_image_is_encoded_a_slice_a_step_while_the_others_decode(llava, monkeypatch):
    """With one slice a step, the text request gets a token on every step of the image's
    encode (its embeddings; each layer's keys and values, attention, MLP; the projector),
    the image request waits at its image meanwhile, and its tokens are those it gets
    alone."""
    _, _, _, llm = llava
    monkeypatch.setattr(model_runner, "STEP_BUDGET_S", 0.0)
    engine = Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=llm.engine.loaded)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text_id = engine.add_request("USER: a text prompt ASSISTANT:", params)
    engine.step()  # its prompt
    image_id = engine.add_request(image_prompt(12), GREEDY)
    cache = engine.executor.runner.encoder_cache
    pixels = llm.engine.input_processor.images.processor(random_image(12))
    num_slices = sum(1 for _ in llm.engine.loaded.model.encode_slices(pixels[None]))
    assert num_slices == 1 + 3 * llm.engine.loaded.config.vision.layers_run  # one row block
    for i in range(num_slices):
        got = {o.request_id for o in engine.step()}
        assert text_id in got and image_id not in got
        assert cache.num_slices == i + 1 and cache.num_encoded == 0
    engine.step()  # the last step runs the projector: the image request goes on next
    assert cache.num_encoded == 1
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs[image_id].outputs[0].token_ids == token_ids(
        llm.generate(image_prompt(12), GREEDY, use_tqdm=False))[0]


def test_the_same_image_hits_the_prefix_cache_and_another_never_does(llava):
    _, _, _, llm = llava
    cached = LLM.from_engine(Engine(EngineConfig(kv_cache_memory="64MiB"),
                                    loaded=llm.engine.loaded))
    text = "What is in the picture, described at length and with care, please?"
    first = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    again = cached.generate(image_prompt(20, text), GREEDY, use_tqdm=False)[0]
    other = cached.generate(image_prompt(21, text), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    # the other image's blocks differ from the image's first block on ("USER: " is 6
    # tokens: the first 16-token block already holds image tokens)
    assert other.num_cached_tokens == 0
    alone = llm.generate(image_prompt(21, text), GREEDY, use_tqdm=False)[0]
    assert other.outputs[0].token_ids == alone.outputs[0].token_ids
    salted = cached.generate({**image_prompt(20, text), "cache_salt": "another user"}, GREEDY,
                             use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0  # the same image under another salt: no hit
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids


def test_image_inputs_are_checked(llava):
    _, _, _, llm = llava
    with pytest.raises(RequestRejected, match="1 image placeholder"):
        llm.generate({"prompt": "USER: <image>\nhi", "multi_modal_data": {
            "image": [random_image(0), random_image(1)]}}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="image token but no image"):
        llm.generate("USER: <image>\nhi", GREEDY, use_tqdm=False)
    with pytest.raises(ImageError, match="base64"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}],
            GREEDY, use_tqdm=False)
    with pytest.raises(ImageError, match="not a usable image"):
        llm.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}],
            GREEDY, use_tqdm=False)


def test_a_text_model_refuses_images(smollm2_llm):
    with pytest.raises(RequestRejected, match="text only"):
        smollm2_llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0)}},
                             GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="text only"):
        smollm2_llm.chat([{"role": "user", "content": [
            {"type": "image", "image": random_image(0)}, {"type": "text", "text": "hi"}]}],
            GREEDY, use_tqdm=False)


def test_the_memory_calculator_counts_the_tower(llava):
    # SigLIP's pooling head is never loaded
    assert_memory_counts(llava[2], llava[3].engine.loaded.config,
                         (".vision_tower.", ".multi_modal_projector."), ".vision_tower.head.")


def assert_memory_counts(reference, config, image_parts: tuple[str, ...],
                         unloaded: str | None = None) -> None:
    """`llmserve memory`'s counts equal transformers' model's parameters: the image side
    (names holding one of `image_parts`) and the whole (less those named `unloaded`)."""
    from llmserve.memory import parameter_counts, vision_parameter_count

    held = {name: p.numel() for name, p in reference.named_parameters()
            if unloaded is None or unloaded not in name}
    image_side = sum(n for name, n in held.items() if any(p in name for p in image_parts))
    assert vision_parameter_count(config) == image_side
    assert parameter_counts(config)[0] == sum(held.values())
