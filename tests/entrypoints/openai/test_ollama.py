"""Ollama's native API through the `ollama` client and langchain-ollama against a live
server: chat whole and streamed, generate, embed, format with a pydantic schema, tools,
list/show/ps/pull/version, the same greedy text as /v1/chat/completions for the same
request, and every refusal in Ollama's shape naming the field."""

import json

import pytest
from pydantic import BaseModel

from tests.entrypoints.openai.conftest import MODEL, run_server

QUESTION = [{"role": "user", "content": "Name three fruits."}]
GREEDY = {"temperature": 0, "num_predict": 24}


def ollama():
    """The `ollama` client, imported on first use."""
    return pytest.importorskip("ollama")


@pytest.fixture(scope="module")
def ol(server):
    return ollama().Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def chat_reply(client):
    """The chat route's greedy reply to the same conversation."""
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24,
                                          temperature=0)


@pytest.fixture(scope="module")
def chat_answer(chat_reply) -> str:
    return chat_reply.choices[0].message.content


@pytest.fixture(scope="module")
def embed_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, engine_options={"runner": "pooling"}) as s:
        yield s


def test_chat_whole_is_the_chat_routes_answer(ol, chat_answer, chat_reply):
    reply = ol.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert reply.message.role == "assistant"
    assert reply.message.content == chat_answer
    assert reply.done and reply.done_reason == chat_reply.choices[0].finish_reason
    assert reply.eval_count == chat_reply.usage.completion_tokens
    assert reply.prompt_eval_count == chat_reply.usage.prompt_tokens
    # measured, not invented: the request's own timeline in nanoseconds
    assert 0 < reply.prompt_eval_duration < reply.total_duration
    assert 0 < reply.eval_duration < reply.total_duration
    assert reply.load_duration == 0


def test_chat_streamed_is_the_whole_answer(ol, chat_answer, chat_reply, server):
    chunks = list(ol.chat(model=f"{MODEL}:latest", messages=QUESTION, options=GREEDY,
                          stream=True))
    assert "".join(c.message.content for c in chunks) == chat_answer
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == chat_reply.usage.completion_tokens
    assert chunks[-1].total_duration > 0
    # newline-delimited JSON, as Ollama streams
    with server.http() as http:
        response = http.post("/api/chat", json={"model": MODEL, "messages": QUESTION,
                                                "options": {"num_predict": 3}})
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 3


def test_generate_is_the_chat_template_or_raw_text(ol, client, chat_answer):
    reply = ol.generate(model=MODEL, prompt=QUESTION[0]["content"], options=GREEDY)
    assert reply.response == chat_answer and reply.done
    streamed = list(ol.generate(model=MODEL, prompt=QUESTION[0]["content"], options=GREEDY,
                                stream=True))
    assert "".join(c.response for c in streamed) == chat_answer
    assert streamed[-1].context == reply.context
    raw = ol.generate(model=MODEL, prompt="The capital of France is", raw=True,
                      options=GREEDY)
    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           max_tokens=24, temperature=0)
    assert raw.response == completion.choices[0].text
    # `context` carries the conversation on: the next prompt is read after it
    again = ol.generate(model=MODEL, prompt="And of Spain?", context=raw.context,
                        options={"temperature": 0, "num_predict": 4})
    assert again.context[:len(raw.context)] == raw.context and again.eval_count == 4


def test_format_with_a_pydantic_schema_is_enforced(ol):
    class Fruit(BaseModel):
        name: str
        color: str

    reply = ol.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a fruit."}],
                    format=Fruit.model_json_schema(), options={"temperature": 0,
                                                              "num_predict": 64})
    Fruit.model_validate_json(reply.message.content)
    plain = ol.chat(model=MODEL, messages=QUESTION, format="json",
                    options={"temperature": 0, "num_predict": 48})
    json.loads(plain.message.content)


# keys in the order the `ollama` client writes them (its models' field order): the same
# tool JSON in both requests renders the same prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


def test_tools_and_their_results_as_on_the_chat_route(ol, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = ol.chat(model=MODEL, messages=ask, tools=[WEATHER], options=GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                          max_tokens=24, temperature=0).choices[0].message
    assert reply.message.content == (chat.content or "")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in chat.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments))
            for c in reply.message.tool_calls or ()] == calls
    # a call and its result sent back, as Ollama's clients send them
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    after = ol.chat(model=MODEL, messages=history, tools=[WEATHER], options=GREEDY)
    openai_history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": "call_1_0",
         "name": "get_weather"}]
    expected = client.chat.completions.create(model=MODEL, messages=openai_history,
                                              tools=[WEATHER], max_tokens=24, temperature=0)
    assert after.message.content == (expected.choices[0].message.content or "")


def test_models_listed_shown_and_running(ol, server, smollm2_gguf):
    (listed,) = ol.list().models
    assert listed.model == f"{MODEL}:latest"
    assert listed.size == smollm2_gguf.stat().st_size
    assert listed.digest == "sha256:" + smollm2_gguf.with_name(
        smollm2_gguf.name + ".sha256").read_text().split()[0]
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.quantization_level == "Q4_1"
    assert listed.details.parameter_size == "135M"
    shown = ol.show(MODEL)
    assert "completion" in shown.capabilities and shown.template
    assert shown.modelinfo["llama.context_length"] == server.engine.max_model_len
    (running,) = ol.ps().models
    assert running.model == f"{MODEL}:latest" and running.size > 0
    with server.http() as http:
        assert http.get("/api/version").json()["version"]
        assert http.head("/").status_code == 200


def test_a_file_is_named_by_its_stem_too(ol, smollm2_gguf):
    reply = ol.generate(model=smollm2_gguf.stem, prompt="Hi", options={"num_predict": 2})
    assert reply.eval_count == 2


def test_pull_reads_the_catalog_and_delete_keeps_the_served_model(ol):
    statuses = [p.status for p in ol.pull("smollm2-135m", stream=True)]
    assert statuses[-1] == "success"
    assert ol.pull("smollm2-135m:latest").status == "success"
    with pytest.raises(ollama().ResponseError) as missing:
        ol.pull("no-such-model")
    assert missing.value.status_code == 404


def test_embed_and_the_older_embeddings_route(embed_server):
    client = ollama().Client(host=embed_server.url, timeout=120)
    openai_vectors = embed_server.client().embeddings.create(
        model=MODEL, input=["apples", "pears"]).data
    embedded = client.embed(model=MODEL, input=["apples", "pears"])
    assert len(embedded.embeddings) == 2
    for ours, theirs in zip(embedded.embeddings, openai_vectors, strict=True):
        assert ours == pytest.approx(theirs.embedding, abs=1e-6)
    assert embedded.prompt_eval_count > 0
    single = client.embeddings(model=MODEL, prompt="apples")
    assert single.embedding == pytest.approx(openai_vectors[0].embedding, abs=1e-6)
    assert client.embed(model=MODEL, input="apples", dimensions=8).embeddings[0].__len__() == 8


def test_embed_truncates_an_input_to_its_beginning(embed_server, tokenizer):
    """`truncate` (on by default) keeps an input's first tokens that fit the context, as
    Ollama does; off, a longer input is a 400."""
    client = ollama().Client(host=embed_server.url, timeout=120)
    limit = embed_server.engine.max_model_len - 1  # a prompt leaves one position
    long = "The library holds books about rivers and mountains. " * 2000  # ~20k tokens
    head = tokenizer.encode(long)[:limit]
    expected = embed_server.client().embeddings.create(model=MODEL, input=[head])
    embedded = client.embed(model=MODEL, input=long)
    assert embedded.embeddings[0] == pytest.approx(expected.data[0].embedding, abs=1e-6)
    assert embedded.prompt_eval_count == limit
    with pytest.raises(ollama().ResponseError) as refused:
        client.embed(model=MODEL, input=long, truncate=False)
    assert refused.value.status_code == 400


def test_langchain_ollama(server, embed_server, chat_answer):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    chat = langchain_ollama.ChatOllama(model=MODEL, base_url=server.url, temperature=0,
                                       num_predict=24)
    assert chat.invoke(QUESTION[0]["content"]).content == chat_answer
    assert "".join(c.content for c in chat.stream(QUESTION[0]["content"])) == chat_answer
    embeddings = langchain_ollama.OllamaEmbeddings(model=MODEL, base_url=embed_server.url)
    assert len(embeddings.embed_query("apples")) == len(embeddings.embed_documents(["a"])[0])


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"model": "no-such-model"}, 404, "model 'no-such-model' not found"),
    ({"options": {"mirostat": 2}}, 400, "mirostat"),
    ({"options": {"num_thread": 8}}, 400, "num_thread"),
    ({"options": {"num_predict": 0}}, 400, "num_predict"),
    ({"options": {"num_ctx": 4}}, 400, "num_ctx"),
    ({"keep_alive": 0}, 400, "keep_alive"),
    ({"think": True}, 400, "does not support thinking"),
    ({"format": "xml"}, 400, "format"),
    ({"template": "{{ .Prompt }}"}, 400, "template"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400,
     "messages[0].images"),
])
def test_refusals_name_the_field_in_ollamas_shape(server, body, status, named):
    request = {"model": MODEL, "messages": QUESTION, "stream": False, **body}
    with server.http() as http:
        response = http.post("/api/chat", json=request)
    assert response.status_code == status
    assert set(response.json()) == {"error"} and named in response.json()["error"]


def test_unknown_routes_and_bad_bodies_answer_in_ollamas_shape(server, smollm2_gguf):
    with server.http() as http:
        missing = http.get("/api/nothing")
        bad = http.post("/api/generate", json={"prompt": "hi"})
        suffix = http.post("/api/generate", json={"model": MODEL, "prompt": "a",
                                                  "suffix": "b"})
        deleted = http.request("DELETE", "/api/delete", json={"model": "smollm2-135m"})
        served = http.request("DELETE", "/api/delete", json={"model": "no-such-model"})
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    assert bad.status_code == 400 and "model" in bad.json()["error"]
    assert suffix.status_code == 400 and "suffix" in suffix.json()["error"]
    assert deleted.status_code == 409 and smollm2_gguf.exists()  # the served model's file
    assert served.status_code == 404


def test_an_empty_request_loads_the_model(ol, server):
    with server.http() as http:
        loaded = http.post("/api/generate", json={"model": MODEL, "stream": False}).json()
        chat = http.post("/api/chat", json={"model": MODEL, "messages": []}).json()
    assert loaded["done_reason"] == "load" and loaded["response"] == ""
    assert chat["done_reason"] == "load"


def test_a_prompt_far_past_the_context_is_refused_while_tokenized(server):
    """A 4 MB prompt is a million tokens: refused once the context's worth is counted
    ("more than N tokens"), not after tokenizing all of it (the tokenizer pool is every
    request's)."""
    huge = "word " * 800_000
    early = f"more than {server.engine.max_model_len} tokens"
    with server.http() as http:
        answers = [http.post("/api/generate", json={"model": MODEL, "stream": False, **body})
                   for body in ({"prompt": huge}, {"prompt": huge, "raw": True},
                                {"prompt": huge, "options": {"num_ctx": 64}})]
        answers.append(http.post("/api/chat", json={
            "model": MODEL, "stream": False, "options": {"num_ctx": 64},
            "messages": [{"role": "user", "content": huge}]}))
    for answer in answers:
        assert answer.status_code == 400 and early in answer.json()["error"]
