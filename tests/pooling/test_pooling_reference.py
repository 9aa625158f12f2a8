"""The pooling runner against `transformers` (and sentence-transformers) on the same weights.

Tiny random checkpoints made here, each with a byte-level tokenizer:

* a Llama causal LM: embeddings with LAST, MEAN and CLS pooling equal transformers' final
  hidden states pooled the same way; the LM head's logits at two tokens as a yes/no
  classifier (Qwen3-Reranker's method) equal transformers' logits there;
* a bare Qwen3 decoder (`Qwen3Model`, tensors without the `model.` prefix and no LM head,
  as embedding models are saved): LAST-token embeddings, and sentence-transformers' own
  pipeline over the same folder;
* a Qwen3 sequence classifier (`Qwen3ForSequenceClassification`, a `score` head) with one
  label and with three: probabilities and cross-encoder scores equal transformers'.

The float32 path: cosine >= 0.9999 and values within 1e-4 everywhere. Batching, chunked
prefill and the prefix cache change no embedding's bits.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from llmserve import LLM, PoolingParams
from tests.tiny_models import save_tiny

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello!",
           "Embeddings map text to vectors; similar texts land close together. " * 3,
           "a"]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=512)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("pool-llama")
    return folder, save_tiny(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
                         folder)


@pytest.fixture(scope="module")
def bare_qwen3(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("pool-qwen3")
    model = save_tiny(transformers.Qwen3Model(transformers.Qwen3Config(**COMMON, head_dim=16)),
                  folder)
    names = json.loads((folder / "config.json").read_text())["architectures"]
    assert names == ["Qwen3Model"]
    return folder, model


@pytest.fixture(scope="module", params=[1, 3], ids=["1-label", "3-labels"])
def classifier(request, tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp(f"pool-cls-{request.param}")
    config = transformers.Qwen3Config(**COMMON, head_dim=16, num_labels=request.param)
    return folder, save_tiny(transformers.Qwen3ForSequenceClassification(config), folder)


def ids_of(folder, text: str) -> list[int]:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), (T, hidden)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]


def pool(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    cos = F.cosine_similarity(ours.double(), reference.double(), dim=0).item()
    assert cos >= 0.9999, f"cosine {cos}"
    assert torch.allclose(ours, reference.float(), atol=1e-4, rtol=1e-4), \
        (ours - reference).abs().max()


def pooling_llm(folder, **options) -> LLM:
    options = {"dtype": "float32", "kv_cache_memory": "16MiB", "runner": "pooling"} | options
    return LLM(str(folder), **options)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled_hidden_states(llama, kind):
    folder, reference = llama
    llm = pooling_llm(folder, pooler_config={"pooling_type": kind, "normalize": False})
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    for text, out in zip(PROMPTS, outputs, strict=True):
        expected = pool(reference_hidden(reference, ids_of(folder, text)), kind)
        assert_close(torch.tensor(out.outputs.embedding), expected)
    # normalised, and cut to the first dimensions first (Matryoshka)
    cut = llm.embed(PROMPTS[0], use_tqdm=False,
                    pooling_params=PoolingParams(dimensions=16, normalize=True))[0]
    expected = pool(reference_hidden(reference, ids_of(folder, PROMPTS[0])), kind)[:16]
    assert_close(torch.tensor(cut.outputs.embedding), F.normalize(expected, dim=0))


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_batching_chunking_and_prefix_hits_change_no_embedding(llama, kind):
    folder, _ = llama
    long = PROMPTS[2]
    pooler = {"pooling_type": kind}
    alone = [pooling_llm(folder, pooler_config=pooler).embed(p, use_tqdm=False)[0]
             .outputs.embedding for p in PROMPTS]
    for options in ({}, {"max_num_batched_tokens": 32}, {"max_num_seqs": 2}):
        llm = pooling_llm(folder, pooler_config=pooler, **options)
        batched = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
        assert batched == alone, options
    if kind == "MEAN":
        return
    llm = pooling_llm(folder)
    llm.embed(long, use_tqdm=False)
    again = llm.encode(long, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # LAST pooling reads the last position only
    assert again.outputs.data.tolist() == alone[2]
    mean = pooling_llm(folder, pooler_config={"pooling_type": "MEAN"})
    mean.embed(long, use_tqdm=False)
    assert mean.encode(long, use_tqdm=False)[0].num_cached_tokens == 0  # needs every row


def test_a_bare_decoder_embeds_like_transformers_and_sentence_transformers(bare_qwen3):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    folder, reference = bare_qwen3
    outputs = pooling_llm(folder).embed(PROMPTS, use_tqdm=False)
    for text, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            hidden = reference(torch.tensor([ids_of(folder, text)])).last_hidden_state[0]
        assert_close(torch.tensor(out.outputs.embedding), F.normalize(hidden[-1], dim=0))
    transformer = Transformer(str(folder))
    st = SentenceTransformer(modules=[
        transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken"),
        Normalize()], device="cpu")
    expected = st.encode(PROMPTS, convert_to_tensor=True, batch_size=1)
    for out, vector in zip(outputs, expected, strict=True):
        assert_close(torch.tensor(out.outputs.embedding), vector)


def test_a_bare_decoder_cannot_generate(bare_qwen3):
    folder, _ = bare_qwen3
    with pytest.raises(Exception, match="no LM head.*--runner pooling"):
        LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")


def test_sequence_classifier_equals_transformers(classifier):
    folder, reference = classifier
    llm = pooling_llm(folder, convert="classify")
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    alone = [llm.classify(p, use_tqdm=False)[0].outputs.probs for p in PROMPTS]
    assert [o.outputs.probs for o in outputs] == alone  # batching changes no bit
    for text, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([ids_of(folder, text)])).logits[0]
        probs = logits.sigmoid() if logits.numel() == 1 else logits.softmax(-1)
        assert_close(torch.tensor(out.outputs.probs), probs)
    raw = llm.classify(PROMPTS[0], use_tqdm=False,
                       pooling_params=PoolingParams(use_activation=False))[0]
    with torch.no_grad():
        logits = reference(torch.tensor([ids_of(folder, PROMPTS[0])])).logits[0]
    assert_close(torch.tensor(raw.outputs.probs), logits)
    if logits.numel() > 2:
        with pytest.raises(ValueError, match="one or two labels"):
            llm.score("query", ["a", "b"], use_tqdm=False)
        return
    # a cross-encoder: the pair through the tokenizer's pair encoding
    import transformers

    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"))
    documents = ["A fox is an animal.", "Paris is in France."]
    scores = llm.score("What is a fox?", documents, use_tqdm=False)
    for document, scored in zip(documents, scores, strict=True):
        ids = hf_tokenizer("What is a fox?", document)["input_ids"]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].sigmoid()[0].item()
        assert scored.outputs.score == pytest.approx(expected, abs=1e-5)


def test_yes_no_tokens_of_the_lm_head_as_a_classifier(llama):
    """Qwen3-Reranker's method: the LM head's logits at "no" and "yes" tokens."""
    folder, reference = llama
    llm = pooling_llm(folder, convert="classify",
                      pooler_config={"classifier_from_token": ["n", "y"]})
    no, yes = ids_of(folder, "n")[0], ids_of(folder, "y")[0]
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    assert [o.outputs.probs for o in outputs] == [
        llm.classify(p, use_tqdm=False)[0].outputs.probs for p in PROMPTS]
    for text, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([ids_of(folder, text)])).logits[0, -1]
        assert_close(torch.tensor(out.outputs.probs), logits[[no, yes]].softmax(-1))
    score = llm.score("Is a fox an animal?", "yes", use_tqdm=False)[0].outputs.score
    ids = ids_of(folder, "Is a fox an animal?") + ids_of(folder, "yes")
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, -1]
    assert score == pytest.approx(logits[[no, yes]].softmax(-1)[1].item(), abs=1e-5)


def test_embedding_scores_are_cosine_similarities(llama):
    folder, _ = llama
    llm = pooling_llm(folder)
    first, *rest = llm.embed(["query", "doc one", "doc two"], use_tqdm=False)
    scores = llm.score("query", ["doc one", "doc two"], use_tqdm=False)
    for scored, doc in zip(scores, rest, strict=True):
        expected = F.cosine_similarity(torch.tensor(first.outputs.embedding),
                                       torch.tensor(doc.outputs.embedding), dim=0).item()
        assert scored.outputs.score == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="2 first texts against 3"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


def test_pooling_and_generation_are_refused_where_they_do_not_belong(llama):
    folder, _ = llama
    pooling = pooling_llm(folder)
    with pytest.raises(ValueError, match="does not generate"):
        pooling.generate("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="no classifier"):
        pooling.classify("hi", use_tqdm=False)
    generating = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="--runner pooling"):
        generating.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="classify needs a classifier"):
        pooling_llm(folder, convert="classify")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        pooling_llm(folder, pooler_config={"pooling_type": "MAX"})


def test_default_model_embeddings_equal_transformers(float32_model, reference_model):
    """The default model's GGUF on the exact path, LAST and MEAN pooling: cosine >= 0.9999
    against transformers' final hidden states (its own reader of the same file)."""
    from tests.engines import llm_on

    texts = ["What is the capital of France?", PROMPTS[2]]
    for kind in ("LAST", "MEAN"):
        llm = llm_on(float32_model, kv_cache_memory="64MiB", runner="pooling",
                     pooler_config={"pooling_type": kind})
        outputs = llm.embed(texts, use_tqdm=False)
        for out in outputs:
            expected = pool(reference_hidden(reference_model, out.prompt_token_ids), kind)
            ours = torch.tensor(out.outputs.embedding)
            cos = F.cosine_similarity(ours.double(), expected.double(), dim=0).item()
            print(f"{kind}: cosine {cos:.8f} over {len(out.prompt_token_ids)} tokens")
            assert cos >= 0.9999
            assert torch.allclose(ours, F.normalize(expected.float(), dim=0), atol=1e-4)
