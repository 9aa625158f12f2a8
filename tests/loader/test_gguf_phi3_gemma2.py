"""Phi-3 and Gemma 2 from GGUF files laid out as llama.cpp writes them
(`tests/gguf_writer.py`: Phi-3's fused `attn_qkv` and `ffn_up` and its LongRoPE factor
tensors, Gemma 2's four norms stored as 1 + w and its soft-caps as metadata): the logits
equal `transformers` on the same checkpoint."""

import pytest
import transformers

from llmserve.loader.gguf import load_gguf
from tests.gguf_writer import write_gguf
from tests.models.test_llama_reference import LOGIT_TOLERANCE
from tests.models.test_phi3_gemma2_reference import COMMON, ORIGINAL, tiny
from tests.reference_checks import logit_diff, model_from, random_ids
from tests.tiny_models import randomize


def checkpoint(kind: str) -> transformers.PreTrainedModel:
    if kind == "gemma2":  # llama.cpp scales Gemma 2's attention by 1/sqrt(head_dim)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **COMMON, head_dim=16, max_position_embeddings=256, sliding_window=24,
            query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0))
    else:
        model = tiny(kind)
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("kind", ["phi3", "phi3-plain", "gemma2"])
def test_logits_equal_transformers(tmp_path, kind):
    reference = checkpoint(kind)
    loaded = load_gguf(write_gguf(reference, tmp_path / f"{kind}.gguf"))
    assert loaded.config.architecture == kind.removesuffix("-plain")
    ids = random_ids(ORIGINAL if kind == "phi3" else 90, 5)
    diff = logit_diff(model_from(loaded), reference, ids)
    print(f"{kind} GGUF: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE
