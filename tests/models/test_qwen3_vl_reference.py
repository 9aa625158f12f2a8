"""Qwen3-VL against `transformers` on a tiny random checkpoint (its ViT with learned
positions interpolated to the image, 2-D rotary positions, whole-image attention, the patch
merger and DeepStack mergers; a Qwen3 decoder with interleaved M-RoPE and the DeepStack rows
added after its first layers): pixel values, M-RoPE positions, image features, logits and
greedy tokens with one and several images and images in several turns; an image request's
tokens unchanged by batching, chunking across its image, preemption and prefix-cache hits,
on the float32 path and the default one."""

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from llmserve import LLM, SamplingParams
from llmserve.config.model import ModelConfig
from llmserve.config.vision import VisionConfig
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.multimodal.images import to_rgb
from llmserve.multimodal.processors import MergedImageProcessor
from llmserve.worker import mrope
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_llava_reference import assert_memory_counts, random_image
from tests.models.test_qwen2_5_vl_reference import (
    assert_chat_follows,
    assert_invariant,
    chat_ids,
    image_prompt,
    our_logits,
    reference_inputs,
)
from tests.reference_checks import assert_greedy_follows
from tests.tiny_models import QWEN_IMAGE_ID, save_tiny_qwen3_vl

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(folder, transformers' model, our float32 LLM)."""
    folder = tmp_path_factory.mktemp("qwen3_vl")
    reference = save_tiny_qwen3_vl(folder).eval()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")
    return folder, reference, llm


def test_the_config_reads_as_transformers_does():
    """The 8B's shape from transformers' defaults: a Qwen3 decoder with interleaved
    sections [24, 20, 20] (unsaid in the config), the tower's DeepStack layers and learned
    positions; each image token's row three DeepStack rows wider than the embedding."""
    from transformers import Qwen3VLConfig

    cfg = Qwen3VLConfig(text_config={"hidden_size": 3584}).to_dict()
    model = ModelConfig.from_hf_config(cfg)
    assert (model.architecture, model.qk_norm) == ("qwen3", True)
    assert (model.mrope_section, model.mrope_interleaved) == ((24, 20, 20), True)
    assert model.rope_theta == 500000.0
    vision = model.vision
    assert (vision.architecture, vision.patch_size, vision.merged_patch) == ("qwen3_vl", 16, 32)
    assert vision.deepstack_layers == (8, 16, 24) and vision.num_position_embeddings == 2304
    assert vision.row_width == 4 * 3584
    with pytest.raises(ValueError, match="out_hidden_size 3584 is not the decoder's"):
        ModelConfig.from_hf_config(Qwen3VLConfig().to_dict())
    bad = {**cfg, "vision_config": {**cfg["vision_config"], "deepstack_visual_indexes": [30]}}
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        ModelConfig.from_hf_config(bad)
    text = {**cfg["text_config"], "rope_parameters": "bad"}
    with pytest.raises(Exception, match="a Qwen3-VL decoder without M-RoPE's mrope_section"):
        ModelConfig.from_hf_config({**cfg, "text_config": text})


def test_interleaved_rotary_equals_transformers():
    """(3, T) positions turned frequency by frequency as transformers' Qwen3-VL text
    rotary embedding turns them: t, h, w interleaved while the row and column sections
    last, at the real head size and the tiny one."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    for head_dim, section in ((128, [24, 20, 20]), (16, [2, 3, 3])):
        config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": section})
        ref = Qwen3VLTextRotaryEmbedding(config)
        positions = torch.stack([torch.arange(40), torch.arange(40) // 3 + 7,
                                 torch.arange(40) % 5 + 2])
        cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions[:, None])
        ours = RotaryEmbedding(head_dim, 64, 5e6, None, tuple(section), True)
        table = ours.at(positions, torch.float32)
        table.look_up()
        assert torch.equal(table._cos_sin[0], cos[0]) and torch.equal(table._cos_sin[1], sin[0])


def test_preprocessing_equals_transformers():
    """Patches of 16 px bit-equal to transformers' processor with Qwen3-VL's bounds and
    normalisation."""
    vision = VisionConfig.from_hf_config({"model_type": "qwen3_vl", "vision_config": {
        "model_type": "qwen3_vl_vision"}})
    bounds = {"size": {"shortest_edge": 65536, "longest_edge": 16777216},
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "patch_size": 16}
    ref = Qwen2VLImageProcessorPil(**bounds)
    ours = MergedImageProcessor.from_config(bounds, vision)
    for image in (random_image(0, 480, 640), random_image(1, 333, 200),
                  random_image(3, 60, 90, "RGBA")):
        out = ref([image], return_tensors="np")
        patches, grid = ours(to_rgb(image))
        t, h, w = out["image_grid_thw"][0].tolist()
        assert (t, grid) == (1, (h // 2, w // 2)), image.size
        assert torch.equal(patches, torch.from_numpy(out["pixel_values"])), image.size


def test_positions_equal_transformers(qwen3):
    folder, reference, llm = qwen3
    images = [random_image(1, 40, 90), random_image(2, 20, 20), random_image(3, 130, 50)]
    ids, placed = chat_ids(llm, images)
    input_ids = torch.tensor([ids])
    expected, delta = reference.model.get_rope_index(
        input_ids, (input_ids == QWEN_IMAGE_ID).int(),
        image_grid_thw=reference_inputs(folder, images)["image_grid_thw"])
    assert np.array_equal(mrope.positions_of(placed, 0, len(ids)), expected[:, 0].numpy())
    after = mrope.positions_of(placed, len(ids), 3)
    assert np.array_equal(after, np.tile(np.arange(len(ids), len(ids) + 3) + int(delta), (3, 1)))


def reference_features(reference, inputs) -> torch.Tensor:
    """transformers' tower: each token's merged row, then its DeepStack rows."""
    out = reference.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def test_image_features_equal_transformers(qwen3):
    """Each image alone through our tower (learned positions interpolated from the 4 x 4
    grid up and down) equals transformers' tower over all of them at once, the DeepStack
    rows included."""
    folder, reference, llm = qwen3
    images = [random_image(0, 40, 50), random_image(1, 90, 30), random_image(2, 16, 16)]
    inputs = reference_inputs(folder, images)
    with torch.inference_mode():
        ref = reference_features(reference, inputs)
        ours, first = [], 0
        for _, h, w in inputs["image_grid_thw"].tolist():
            patches = inputs["pixel_values"][first:first + h * w]
            ours.append(llm.engine.loaded.model.encode_images(patches[None],
                                                              (h // 2, w // 2))[0])
            first += h * w
    ours = torch.cat(ours)
    diff = (ours - ref).abs().max().item()
    print(f"image features (and DeepStack rows) max |diff| vs transformers {diff:.2e}")
    assert ours.shape == ref.shape == (ref.shape[0], 3 * 64) and diff <= 1e-5


def test_image_features_sliced_by_rows_equal_transformers(qwen3, monkeypatch):
    from llmserve.models import qwen_vision

    folder, reference, llm = qwen3
    monkeypatch.setattr(qwen_vision, "SLICE_ROWS", 12)
    monkeypatch.setattr(qwen_vision, "SLICE_PAIRS", 12 * 40)
    inputs = reference_inputs(folder, [random_image(4, 64, 48)])  # 8 x 6 tokens
    with torch.inference_mode():
        ref = reference_features(reference, inputs)
        _, h, w = inputs["image_grid_thw"][0].tolist()
        slices = llm.engine.loaded.model.encode_slices(inputs["pixel_values"][None],
                                                       (h // 2, w // 2))
        count = 0
        while True:
            try:
                next(slices)
            except StopIteration as done:
                ours = done.value[0]
                break
            count += 1
    # per layer 16 q/k/v blocks of 12 rows, 12 blocks of 16 queries, 16 MLP blocks; one for
    # the patch embedding, one for each DeepStack merger
    assert count == 1 + 4 * (16 + 12 + 16) + 2
    assert (ours - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_reference(qwen3, num_images):
    folder, reference, llm = qwen3
    images = [random_image(i, 40 + 17 * i, 50 + 20 * i) for i in range(num_images)]
    ids, placed = chat_ids(llm, images)
    ours = our_logits(llm, ids, placed)
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        ref = reference(input_ids=input_ids, **reference_inputs(folder, images),
                        mm_token_type_ids=(input_ids == QWEN_IMAGE_ID).int()).logits[0]
    diff = (ours - ref).abs().max().item()
    print(f"{num_images} image(s): max |logit diff| over {len(ids)} positions {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_logits_need_the_deepstack_rows(qwen3):
    """Without the DeepStack rows (the embedding alone in the image's place) the logits
    move: the rows reach the decoder."""
    folder, reference, llm = qwen3
    images = [random_image(7, 40, 50)]
    ids, placed = chat_ids(llm, images)
    model = llm.engine.loaded.model
    full = our_logits(llm, ids, placed)
    encode = model.encode_images
    try:
        model.encode_images = lambda *a: encode(*a)[..., :model.config.hidden_size]
        plain = our_logits(llm, ids, placed)
    finally:
        del model.encode_images
    assert (full - plain).abs().max().item() > 1e-2


def test_greedy_matches_reference_in_a_chat_of_several_turns(qwen3):
    assert_chat_follows(*qwen3)


@pytest.mark.parametrize("path", ["float32", "default"])
def test_batching_chunking_preemption_and_cache_hits_change_no_output(qwen3, path):
    """Chunks of 8 tokens split the images (and their DeepStack rows) across steps."""
    folder, _, _ = qwen3
    assert_invariant(folder, path, [
        image_prompt(10), "<|im_start|>user\na text prompt beside it<|im_end|>\n"
        "<|im_start|>assistant\n", image_prompt(11, "And what is this one?", (30, 30))])


def test_the_memory_calculator_counts_the_tower(qwen3):
    _, reference, llm = qwen3
    assert_memory_counts(reference, llm.engine.loaded.config, (".visual.",))


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory, smollm2_gguf):
    """(qwen3vl decoder GGUF, its qwen3vl_merger projector file, transformers' Qwen3-VL on
    the same weights, the image token, the decoder alone, its tokenizer's metadata):
    smollm2's vocabulary plus Qwen's image tokens, the
    real model's patches (16 px) and a 6 x 6 position grid."""
    import transformers
    from gguf import GGMLQuantizationType as QT

    from llmserve.gguf_meta import open_gguf, read_metadata
    from tests.gguf_writer import with_control_tokens, write_gguf, write_qwen3_mmproj
    from tests.tiny_models import QWEN2_5_VL_TEMPLATE, randomize

    folder = tmp_path_factory.mktemp("qwen3-gguf")
    meta = read_metadata(open_gguf(smollm2_gguf))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokenizer, image = with_control_tokens(tokenizer, [
        "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    tokenizer["tokenizer.chat_template"] = QWEN2_5_VL_TEMPLATE
    text = dict(vocab_size=len(tokenizer["tokenizer.ggml.tokens"]), hidden_size=64,
                intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=36, deepstack_visual_indexes=[1, 2])
    model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        vision_config=vision, text_config={**text, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        image_token_id=image, video_token_id=image, vision_start_token_id=image + 1,
        vision_end_token_id=image + 2))
    randomize(model)
    model.eval()
    decoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    decoder.model.load_state_dict(model.model.language_model.state_dict())
    decoder.lm_head.load_state_dict(model.lm_head.state_dict())
    gguf_path = write_gguf(decoder, folder / "text.gguf", QT.F32, {
        **tokenizer, "qwen3vl.rope.dimension_sections": [2, 3, 3, 0],
        "qwen3vl.n_deepstack_layers": 2}, arch="qwen3vl")
    mmproj = write_qwen3_mmproj(model, folder / "mmproj.gguf", QT.F32)
    return gguf_path, mmproj, model, image, decoder, tokenizer


def test_gguf_with_a_qwen3_projector_file_matches_transformers(qwen3_gguf):
    """A qwen3vl GGUF decoder and its qwen3vl_merger projector file (images resized within
    llama.cpp's 8 to 4,096 tokens): greedy tokens follow transformers' on the same
    weights."""
    gguf_path, mmproj, reference, image_token, _, _ = qwen3_gguf
    llm = LLM(str(gguf_path), mmproj=str(mmproj), dtype="float32", kv_cache_memory="64MiB")
    images = [random_image(40, 230, 300), random_image(41, 100, 150)]
    content = [{"type": "image", "image": im} for im in images] + [
        {"type": "text", "text": "What is in the pictures?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    ids = out.prompt_token_ids
    processor = Qwen2VLImageProcessorPil(min_pixels=8 * 32 * 32, max_pixels=4096 * 32 * 32,
                                         patch_size=16, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3)
    batch = processor(images, return_tensors="np")
    inputs = {"pixel_values": torch.from_numpy(np.asarray(batch["pixel_values"])),
              "image_grid_thw": torch.from_numpy(np.asarray(batch["image_grid_thw"]))}
    assert ids.count(image_token) == int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    assert_greedy_follows(reference, ids, out.outputs[0].token_ids, image_token,
                          type_ids="mm_token_type_ids", **inputs)


def test_a_projector_and_decoder_of_different_families_are_refused(qwen3_gguf, tmp_path):
    """A Qwen3-VL projector before a qwen2vl decoder (M-RoPE by sections), or before a
    qwen3vl decoder that adds fewer DeepStack rows than the projector gives, is refused by
    name."""
    from gguf import GGMLQuantizationType as QT

    from tests.gguf_writer import write_gguf

    gguf_path, mmproj, _, _, decoder, metadata = qwen3_gguf
    qwen2vl = write_gguf(decoder, tmp_path / "qwen2vl.gguf", QT.F32, {
        **metadata, "qwen2vl.rope.dimension_sections": [2, 3, 3, 0]}, arch="qwen2vl")
    with pytest.raises(Exception, match="Qwen3-VL projector; it needs a qwen3vl decoder"):
        LLM(str(qwen2vl), mmproj=str(mmproj), kv_cache_memory="64MiB")
    one = write_gguf(decoder, tmp_path / "one.gguf", QT.F32, {
        **metadata, "qwen3vl.rope.dimension_sections": [2, 3, 3, 0],
        "qwen3vl.n_deepstack_layers": 1}, arch="qwen3vl")
    with pytest.raises(Exception, match="gives 2 DeepStack rows an image token; one.gguf "
                                        "adds 1"):
        LLM(str(one), mmproj=str(mmproj), kv_cache_memory="64MiB")
