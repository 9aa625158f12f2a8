"""Qwen2.5-VL against `transformers` on a tiny random checkpoint (its ViT with 2-D rotary
positions, windowed and whole-image attention and the patch merger; a Qwen2 decoder with
M-RoPE): pixel values and token grids, M-RoPE positions, image features, logits and
greedy tokens with one and several images of different sizes and images in several
turns; an image request's tokens unchanged by batching, chunking across its image,
preemption and prefix-cache hits, on the float32 path and the default one."""

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.config.vision import VisionConfig
from llmserve.engine.engine import Engine
from llmserve.engine.input_processor import RequestRejected
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache
from llmserve.multimodal.images import ImageError, to_rgb
from llmserve.multimodal.processors import MergedImageProcessor
from llmserve.worker import mrope
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_llava_reference import assert_memory_counts, random_image
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import QWEN_IMAGE_ID, save_tiny_qwen2_5_vl

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, transformers' model, our float32 LLM)."""
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    reference = save_tiny_qwen2_5_vl(folder).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    return folder, reference, llm


def reference_inputs(folder, images) -> dict[str, torch.Tensor]:
    """pixel_values (all images' patches) and image_grid_thw as transformers makes them."""
    out = Qwen2VLImageProcessorPil.from_pretrained(folder)(images, return_tensors="np")
    return {"pixel_values": torch.from_numpy(np.asarray(out["pixel_values"])),
            "image_grid_thw": torch.from_numpy(np.asarray(out["image_grid_thw"]))}


def test_preprocessing_equals_transformers():
    """Patches bit-equal to transformers' PIL processor and the same grid, at the real
    model's patch size and pixel bounds (and tight ones), for landscape, portrait, small,
    huge, transparent and grey images; an image too thin is refused by name."""
    vision = VisionConfig.from_hf_config({"model_type": "qwen2_5_vl", "vision_config": {
        "model_type": "qwen2_5_vl_vision"}})
    images = [random_image(0, 480, 640), random_image(1, 333, 200), random_image(2, 20, 21),
              random_image(3, 60, 90, "RGBA"), random_image(4, 1100, 700, "L"),
              random_image(5, 2000, 1500)]
    for bounds in ({}, {"min_pixels": 128 * 28 * 28, "max_pixels": 256 * 28 * 28}):
        ref = Qwen2VLImageProcessorPil(**bounds)
        ours = MergedImageProcessor.from_config(bounds, vision)
        for image in images:
            out = ref([image], return_tensors="np")
            patches, grid = ours(to_rgb(image))
            t, h, w = out["image_grid_thw"][0].tolist()
            assert (t, grid) == (1, (h // 2, w // 2)), image.size
            assert torch.equal(patches, torch.from_numpy(out["pixel_values"])), image.size
    with pytest.raises(ImageError, match="more than 200 times"):
        ours(random_image(6, 2, 500))


def chat_ids(llm, images, text="What is in these pictures?") -> tuple[list[int], list]:
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": text}]
    prompts = llm.engine.input_processor.images
    rendered, inputs = prompts.render_chat(llm.tokenizer, [{"role": "user",
                                                              "content": content}])
    return prompts.encode(llm.tokenizer, rendered, inputs)


def test_an_image_takes_one_token_per_merged_patch(qwen):
    """The ids Qwen2.5-VL's processor makes of the same text: each image's pad token
    repeated once per 2 x 2 patches of the image as resized (its grid from transformers'
    image processor), the text around tokenized as transformers' tokenizer does."""
    from transformers import PreTrainedTokenizerFast

    folder, _, llm = qwen
    images = [random_image(1, 40, 90), random_image(2, 20, 20), random_image(3, 130, 50)]
    grids = reference_inputs(folder, images)["image_grid_thw"].tolist()
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Compare"
            "<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|>"
            "<|vision_end|>.<|im_end|>\n<|im_start|>assistant\n")
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join("<|image_pad|>" * (h * w // 4) + piece
                                   for (_, h, w), piece in zip(grids, pieces[1:], strict=True))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids, placed = llm.engine.input_processor.images.encode(llm.tokenizer, text, images)
    assert ids == tokenizer(expanded)["input_ids"]
    assert [p.grid for p in placed] == [(h // 2, w // 2) for _, h, w in grids]
    assert [p.length for p in placed] == [h * w // 4 for _, h, w in grids]
    assert [ids[p.offset - 1] for p in placed] == [258] * 3  # after each vision start


def test_positions_equal_transformers(qwen):
    """M-RoPE's (3, T) positions of a prompt with images of different shapes, whole and
    a chunk at a time, equal transformers' `get_rope_index`; after the prompt, every
    position moved by the same delta."""
    folder, reference, llm = qwen
    images = [random_image(1, 40, 90), random_image(2, 20, 20), random_image(3, 130, 50)]
    ids, placed = chat_ids(llm, images)
    input_ids = torch.tensor([ids])
    expected, delta = reference.model.get_rope_index(
        input_ids, (input_ids == QWEN_IMAGE_ID).int(),
        image_grid_thw=reference_inputs(folder, images)["image_grid_thw"])
    assert np.array_equal(mrope.positions_of(placed, 0, len(ids)), expected[:, 0].numpy())
    chunks = [mrope.positions_of(placed, lo, min(7, len(ids) - lo))
              for lo in range(0, len(ids), 7)]
    assert np.array_equal(np.concatenate(chunks, axis=1), expected[:, 0].numpy())
    after = mrope.positions_of(placed, len(ids), 5)
    assert np.array_equal(after, np.tile(np.arange(len(ids), len(ids) + 5) + int(delta), (3, 1)))


def test_image_features_equal_transformers(qwen):
    """Each image alone through our tower (windows of 2 x 2 tokens, partial at the
    edges) equals transformers' tower over all of them at once."""
    folder, reference, llm = qwen
    images = [random_image(0, 40, 50), random_image(1, 90, 30), random_image(2, 64, 64)]
    inputs = reference_inputs(folder, images)
    with torch.inference_mode():
        ref = reference.model.visual(inputs["pixel_values"],
                                     grid_thw=inputs["image_grid_thw"]).pooler_output
        ours, first = [], 0
        for _, h, w in inputs["image_grid_thw"].tolist():
            patches = inputs["pixel_values"][first:first + h * w]
            ours.append(llm.engine.loaded.model.encode_images(patches[None],
                                                              (h // 2, w // 2))[0])
            first += h * w
    ours = torch.cat(ours)
    diff = (ours - ref).abs().max().item()
    print(f"image features max |diff| vs transformers {diff:.2e}")
    assert ours.shape == ref.shape and diff <= 1e-5


def test_image_features_sliced_by_rows_equal_transformers(qwen, monkeypatch):
    """Slices of a few rows give the same rows: q, k and v and the MLP 12 rows at a time,
    two 16-patch windows a slice, the whole-image layers' queries 16 at a time against
    all 192 keys."""
    from llmserve.models import qwen_vision
    from llmserve.models.vision import run_slices

    folder, reference, llm = qwen
    monkeypatch.setattr(qwen_vision, "SLICE_ROWS", 12)
    monkeypatch.setattr(qwen_vision, "SLICE_PAIRS", 12 * 40)
    inputs = reference_inputs(folder, [random_image(4, 64, 48)])  # 8 x 6 tokens
    model = llm.engine.loaded.model
    with torch.inference_mode():
        ref = reference.model.visual(inputs["pixel_values"],
                                     grid_thw=inputs["image_grid_thw"]).pooler_output
        _, h, w = inputs["image_grid_thw"][0].tolist()
        slices = model.encode_slices(inputs["pixel_values"][None], (h // 2, w // 2))
        count = 0

        def counted():
            nonlocal count
            while True:
                try:
                    next(slices)
                except StopIteration as done:
                    return done.value
                count += 1
                yield

        ours = run_slices(counted())[0]
    # per layer 16 q/k/v and 16 MLP blocks of 12 rows; 6 slices of windows or 12 blocks of
    # whole-image queries; one for the patch embedding
    assert count == 1 + 2 * (16 + 6 + 16) + 2 * (16 + 12 + 16)
    assert (ours - ref).abs().max().item() <= 1e-5


def our_logits(llm, ids: list[int], placed: list) -> torch.Tensor:
    """Logits at every position of one prompt through the paged path with M-RoPE's
    positions, its image tokens taking the images' rows."""
    model = llm.engine.loaded.model
    cfg = model.config
    index = torch.tensor([i for i, t in enumerate(ids) if t == QWEN_IMAGE_ID])
    with torch.inference_mode():
        rows = torch.cat([model.encode_images(m.pixel_values[None], m.grid)[0]
                          for m in placed])
        block_size, n = 16, len(ids)
        kv = KVCache.allocate(cfg.num_hidden_layers, -(-n // block_size), block_size,
                              cfg.num_key_value_heads, cfg.head_dim, torch.float32)
        meta = AttentionMetadata.build([n], [0], [list(range(-(-n // block_size)))],
                                       block_size,
                                       backend=attention_backend(torch.device("cpu")))
        positions = torch.from_numpy(mrope.positions_of(placed, 0, n))
        hidden = model(torch.tensor(ids), positions, kv, meta, embeds=(index, rows))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_reference(qwen, num_images):
    folder, reference, llm = qwen
    images = [random_image(i, 40 + 17 * i, 50 + 20 * i) for i in range(num_images)]
    ids, placed = chat_ids(llm, images)
    ours = our_logits(llm, ids, placed)
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        ref = reference(input_ids=input_ids, **reference_inputs(folder, images),
                        mm_token_type_ids=(input_ids == QWEN_IMAGE_ID).int()).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{num_images} image(s), {len(placed)} runs: max |logit diff| over {len(ids)} "
          f"positions {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_reference_in_a_chat_of_several_turns(qwen):
    assert_chat_follows(*qwen)


def assert_chat_follows(folder, reference, llm) -> None:
    """A chat with images in two turns: each image a run of one pad token per merged
    patch, our greedy tokens transformers' argmax on its whole forwards."""
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
    inputs = reference_inputs(folder, [first, second])
    assert ids.count(QWEN_IMAGE_ID) == int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, QWEN_IMAGE_ID,
                          type_ids="mm_token_type_ids", **inputs)


def image_prompt(seed: int, text: str = "What is this?", size=(40, 70)) -> dict:
    return {"prompt": f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}"
                      f"<|im_end|>\n<|im_start|>assistant\n",
            "multi_modal_data": {"image": random_image(seed, *size)}}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_invariant(folder, path: str, prompts: list) -> tuple[LLM, LLM, LLM]:
    """`prompts` (image and text requests) give their tokens alone when batched, chunked
    8 tokens a step (images split across steps), preempted (7 blocks of KV cache) and
    hit in the prefix cache (an image chat sent twice); returns the LLM on `path`, the
    chunked and the cached one, for the caller's own checks."""
    llm = LLM(str(folder), dtype="float32" if path == "float32" else "auto",
              kv_cache_memory="64MiB")
    loaded = llm.engine.loaded
    alone = [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone  # batched
    chunked = LLM.from_engine(Engine(EngineConfig(
        kv_cache_memory="64MiB", max_num_batched_tokens=8, enable_prefix_caching=False),
        loaded=loaded))
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == alone
    per_token = llm.engine.kv_plan.bytes_per_token
    tight = LLM.from_engine(Engine(EngineConfig(kv_cache_memory=7 * 16 * per_token),
                                   loaded=loaded))
    assert token_ids(tight.generate(prompts * 3, GREEDY, use_tqdm=False)) == alone * 3
    assert tight.engine.scheduler.num_preemptions > 0
    cached = LLM.from_engine(Engine(EngineConfig(kv_cache_memory="64MiB"), loaded=loaded))
    first = cached.generate(image_prompt(20, LONG_QUESTION), GREEDY, use_tqdm=False)[0]
    again = cached.generate(image_prompt(20, LONG_QUESTION), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    return llm, chunked, cached


LONG_QUESTION = "What is in the picture, described at length and with care, please?"


@pytest.mark.parametrize("path", ["float32", "default"])
def test_batching_chunking_preemption_and_cache_hits_change_no_output(qwen, path):
    folder, _, _ = qwen
    prompts = [image_prompt(10), "<|im_start|>user\na text prompt beside it<|im_end|>\n"
               "<|im_start|>assistant\n",
               image_prompt(11, "And what is this one, in more words?", (30, 30)),
               "<|im_start|>user\nanother text prompt, a little longer<|im_end|>\n"
               "<|im_start|>assistant\n"]
    # the images (45 and 16 tokens) split across steps, each encoded once
    llm, chunked, cached = assert_invariant(folder, path, prompts)
    assert chunked.engine.executor.runner.encoder_cache.num_encoded == 2
    other = cached.generate(image_prompt(21, LONG_QUESTION), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0  # the image starts in the first block
    assert other.outputs[0].token_ids == token_ids(
        llm.generate(image_prompt(21, LONG_QUESTION), GREEDY, use_tqdm=False))[0]


def test_image_runs_are_checked(qwen):
    """A token-id prompt's run of the image token: one (expanded to the image's size) or
    exactly the image's size; any other length is refused, naming the size."""
    _, _, llm = qwen
    image = random_image(0, 40, 70)  # 5 x 9 tokens
    start = llm.tokenizer.encode("<|im_start|>user\n<|vision_start|>",
                                 add_special_tokens=False)
    end = llm.tokenizer.encode("<|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)
    (one,) = llm.generate({"prompt_token_ids": start + [QWEN_IMAGE_ID] + end,
                           "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    (full,) = llm.generate({"prompt_token_ids": start + [QWEN_IMAGE_ID] * 45 + end,
                            "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == full.prompt_token_ids
    assert one.outputs[0].token_ids == full.outputs[0].token_ids
    with pytest.raises(RequestRejected, match="takes 45 image tokens"):
        llm.generate({"prompt_token_ids": start + [QWEN_IMAGE_ID] * 44 + end,
                      "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)


def test_the_memory_calculator_counts_the_tower(qwen):
    _, reference, llm = qwen
    assert_memory_counts(reference, llm.engine.loaded.config, (".visual.",))


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory, smollm2_gguf):
    """(qwen2vl decoder GGUF, its qwen2.5vl projector file, transformers' Qwen2.5-VL on
    the same weights, the image token): smollm2's vocabulary plus Qwen's image tokens
    (control tokens), the real model's patches (14 px) and windows (112 px)."""
    import transformers
    from gguf import GGMLQuantizationType as QT

    from llmserve.gguf_meta import open_gguf, read_metadata
    from tests.gguf_writer import with_control_tokens, write_gguf, write_qwen_mmproj
    from tests.tiny_models import QWEN2_5_VL_TEMPLATE, randomize

    folder = tmp_path_factory.mktemp("qwen-gguf")
    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokenizer, image = with_control_tokens(tokenizer, [
        "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    tokenizer["tokenizer.chat_template"] = QWEN2_5_VL_TEMPLATE
    text = dict(vocab_size=len(tokenizer["tokenizer.ggml.tokens"]), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=None,
                eos_token_id=None)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1, 3], out_hidden_size=64, hidden_act="silu")
    model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config={**text, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        image_token_id=image, video_token_id=image, vision_start_token_id=image + 1,
        vision_end_token_id=image + 2))
    randomize(model)
    model.eval()
    decoder = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text,
                                                                     rope_theta=10000.0))
    decoder.model.load_state_dict(model.model.language_model.state_dict())
    decoder.lm_head.load_state_dict(model.lm_head.state_dict())
    gguf_path = write_gguf(decoder, folder / "text.gguf", QT.F32, {
        **tokenizer, "qwen2vl.rope.dimension_sections": [2, 3, 3, 0]}, arch="qwen2vl")
    mmproj = write_qwen_mmproj(model, folder / "mmproj.gguf", QT.F32)
    return gguf_path, mmproj, model, image


def test_gguf_with_a_qwen_projector_file_matches_transformers(qwen_gguf):
    """A qwen2vl GGUF decoder and its qwen2.5vl projector file: images of 2 x 3 and 1 x 2
    windows, resized within llama.cpp's 8 to 4,096 tokens an image; greedy tokens follow
    transformers' on the same weights (processor bounds set to llama.cpp's)."""
    gguf_path, mmproj, reference, image_token = qwen_gguf
    llm = LLM(str(gguf_path), mmproj=str(mmproj), dtype="float32", kv_cache_memory="64MiB")
    images = [random_image(40, 230, 300), random_image(41, 100, 150)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in the pictures?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    processor = Qwen2VLImageProcessorPil(min_pixels=8 * 28 * 28, max_pixels=4096 * 28 * 28)
    batch = processor(images, return_tensors="np")
    inputs = {"pixel_values": torch.from_numpy(np.asarray(batch["pixel_values"])),
              "image_grid_thw": torch.from_numpy(np.asarray(batch["image_grid_thw"]))}
    assert inputs["image_grid_thw"].tolist() == [[1, 16, 22], [1, 8, 10]]
    assert ids.count(image_token) == 8 * 11 + 4 * 5
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, image_token,
                          type_ids="mm_token_type_ids", **inputs)


def test_a_projector_for_another_family_is_refused(qwen_gguf, smollm2_gguf):
    gguf_path, mmproj, _, _ = qwen_gguf
    with pytest.raises(Exception, match="Qwen2.5-VL projector; it needs a qwen2vl decoder"):
        LLM(str(smollm2_gguf), mmproj=str(mmproj), kv_cache_memory="64MiB")


def test_llmserve_memory_says_what_an_image_costs(qwen):
    from llmserve.entrypoints.cli.memory_report import memory_report

    folder, _, _ = qwen
    report = memory_report(str(folder), 1, 256, "float32", None, "64MiB", 16)
    assert "each image takes one token per 8 x 8 px as resized" in report
