"""The pooling runner's routes over a real socket, through the clients people use: the
`openai` SDK's `embeddings.create` (which asks for base64 unless told otherwise),
langchain-openai's `OpenAIEmbeddings`, and plain HTTP for /v1/score, /rerank (Jina/Cohere
shape) and /classify. Every number equals the offline API's on the same weights."""

import base64
import struct

import httpx
import pytest
import torch

from llmserve import LLM, PoolingParams
from tests.engines import llm_on
from tests.entrypoints.openai.conftest import MODEL, run_server
from tests.tiny_models import save_tiny

TEXTS = ["The cat sat on the mat.", "A dog barked at the mailman.",
         "Stock prices rose sharply today."]


@pytest.fixture(scope="module")
def offline(loaded_model) -> LLM:
    return llm_on(loaded_model, kv_cache_memory="64MiB", runner="pooling")


@pytest.fixture(scope="module")
def embed_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, engine_options={"runner": "pooling"}) as s:
        yield s


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    """A tiny random Qwen3 cross-encoder (one label, a `score` head)."""
    import transformers

    folder = tmp_path_factory.mktemp("reranker")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=256,
                                      max_position_embeddings=512, num_labels=1)
    save_tiny(transformers.Qwen3ForSequenceClassification(config), folder)
    return folder


def vectors(outputs) -> list[list[float]]:
    return [o.outputs.embedding for o in outputs]


def test_openai_sdk_embeddings_equal_the_offline_ones(embed_server, offline):
    client = embed_server.client()
    expected = vectors(offline.embed(TEXTS, use_tqdm=False))
    # the SDK asks for base64 and decodes it itself
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert [d.embedding for d in reply.data] == expected
    assert reply.usage.prompt_tokens == sum(len(offline.tokenizer.encode(t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert floats.data[0].embedding == expected[0]
    # token ids, one list or several
    ids = offline.tokenizer.encode(TEXTS[1])
    assert client.embeddings.create(model=MODEL, input=ids,
                                    encoding_format="float").data[0].embedding == expected[1]
    many = client.embeddings.create(model=MODEL, input=[ids, ids], encoding_format="float")
    assert [d.embedding for d in many.data] == [expected[1], expected[1]]


def test_special_tokens_and_salt(embed_server, offline):
    """add_special_tokens: false tokenizes without them (what the offline API gets as ids);
    a cache_salt keeps the request's blocks its own (the same vector either way)."""
    ids = offline.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    expected = vectors(offline.embed({"prompt_token_ids": ids}, use_tqdm=False))[0]
    with embed_server.http() as http:
        body = {"input": TEXTS[0], "add_special_tokens": False, "cache_salt": "tenant-a"}
        reply = http.post("/v1/embeddings", json=body).json()
    assert reply["data"][0]["embedding"] == expected


def test_dimensions_cut_then_normalise(embed_server, offline):
    reply = embed_server.client().embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32,
                                                    encoding_format="float")
    vector = torch.tensor(reply.data[0].embedding)
    assert vector.shape == (32,)
    assert vector.norm().item() == pytest.approx(1.0, abs=1e-6)
    full = torch.tensor(vectors(offline.embed(TEXTS[0], use_tqdm=False))[0])
    assert torch.allclose(vector, torch.nn.functional.normalize(full[:32], dim=0), atol=1e-6)


def test_base64_is_little_endian_float32(embed_server, offline):
    with embed_server.http() as http:
        body = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[2],
                                                 "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == vectors(offline.embed(TEXTS[2], use_tqdm=False))[0]


def test_langchain_openai_embeddings(embed_server, offline):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not tiktoken's ids (as for any
    # server that is not OpenAI's)
    embeddings = OpenAIEmbeddings(model=MODEL, base_url=embed_server.base_url,
                                  api_key="none", check_embedding_ctx_length=False,
                                  max_retries=0)
    expected = vectors(offline.embed(TEXTS, use_tqdm=False))
    assert embeddings.embed_documents(TEXTS) == expected
    assert embeddings.embed_query(TEXTS[0]) == expected[0]


def test_score_and_rerank_on_an_embedding_model(embed_server, offline):
    expected = [s.outputs.score for s in offline.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    with embed_server.http() as http:
        score = http.post("/v1/score", json={"model": MODEL, "text_1": TEXTS[0],
                                             "text_2": TEXTS[1:]}).json()
        assert [d["score"] for d in score["data"]] == expected
        rerank = http.post("/v1/rerank", json={"model": MODEL, "query": TEXTS[0],
                                               "documents": TEXTS[1:]}).json()
        top = http.post("/rerank", json={"query": TEXTS[0], "top_n": 1,
                                         "return_documents": False,
                                         "documents": [{"text": t} for t in TEXTS[1:]]}).json()
    order = sorted(range(2), key=lambda i: -expected[i])
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["relevance_score"] for r in rerank["results"]] == [expected[i] for i in order]
    assert rerank["results"][0]["document"] == {"text": TEXTS[1:][order[0]]}
    assert top["results"] == [{"index": order[0], "relevance_score": expected[order[0]]}]
    assert rerank["usage"]["total_tokens"] > 0


def test_cross_encoder_rerank_and_classify(reranker_folder):
    offline = LLM(str(reranker_folder), dtype="float32", kv_cache_memory="16MiB",
                  runner="pooling", convert="classify")
    documents = ["A fox is an animal.", "Paris is in France.", "Foxes eat mice."]
    expected = [s.outputs.score for s in offline.score("What is a fox?", documents,
                                                        use_tqdm=False)]
    options = {"runner": "pooling", "convert": "classify", "kv_cache_memory": "16MiB"}
    with run_server(reranker_folder, None, engine_options=options) as server, \
            server.http() as http:
        rerank = http.post("/v2/rerank", json={"query": "What is a fox?",
                                               "documents": documents}).json()
        classify = http.post("/classify", json={"input": documents[:2]}).json()
        raw = http.post("/classify", json={"input": documents[0], "use_activation": False})
        embedded = http.post("/v1/embeddings", json={"input": "x"})
    assert sorted(r["relevance_score"] for r in rerank["results"]) == sorted(expected)
    for r in rerank["results"]:
        assert r["relevance_score"] == expected[r["index"]]
    probs = [c.outputs.probs for c in offline.classify(documents[:2], use_tqdm=False)]
    assert [d["probs"] for d in classify["data"]] == probs
    assert classify["data"][0]["num_classes"] == 1
    logits = offline.classify(documents[0], use_tqdm=False,
                              pooling_params=PoolingParams(use_activation=False))
    assert raw.json()["data"][0]["probs"] == logits[0].outputs.probs
    # a classifier server embeds too (the pooled state), on request
    assert embedded.status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": [10**9]}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/classify", {"input": "x"}, "model"),
    ("/v1/embeddings", {"model": "other", "input": "x"}, "model"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {"a": 1}},
     "mm_processor_kwargs"),
])
def test_bad_pooling_requests_get_a_400_naming_the_field(embed_server, path, body, param):
    with embed_server.http() as http:
        reply = http.post(path, json=body)
    assert reply.status_code in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_each_runner_refuses_the_other_ones_routes(embed_server, server):
    with embed_server.http() as http:
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 400
    assert "does not generate" in chat.json()["error"]["message"]
    reply = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert reply.status_code == 400
    assert "--runner pooling" in reply.json()["error"]["message"]
