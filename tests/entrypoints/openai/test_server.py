"""The server driven by the official `openai` client: completions, chat, streaming, usage."""

import uuid

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colours."}]


def _stream_completion(client, **kwargs):
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return chunks, text


def _stream_chat(client, **kwargs):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_model_is_retrieved_by_its_id(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "llmserve")
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("org/no-such-model")
    assert refused.value.body["code"] == "model_not_found"
    assert refused.value.body["param"] == "model"


def test_completion_usage_and_finish_reason(client, tokenizer):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.text
    assert resp.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    assert resp.model == MODEL and resp.object == "text_completion"


def test_completion_stream_equals_whole_for_the_same_seed(client):
    options = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 1234}
    whole = client.completions.create(model=MODEL, **options)
    chunks, text = _stream_completion(client, stream_options={"include_usage": True},
                                      **options)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(whole.usage)


def test_cached_tokens_are_the_prefix_cache_hit(client, server):
    """A prompt seen for the first time hits nothing; sent again, every full block but the
    one holding its last token (which must be computed to sample from) is a hit."""
    prompt = (f"{uuid.uuid4().hex} is an id no other test sends, so nothing of this prompt "
              "is cached before it arrives; here begins the long story of that id")
    first, again = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                              temperature=0) for _ in range(2))
    block_size = server.engine.engine.kv_manager.block_size
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 2 * block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == \
        (num_prompt - 1) // block_size * block_size
    assert again.choices[0].text == first.choices[0].text


def _counts(usage):
    """Token counts without cached_tokens, which grow as the prefix cache warms up."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_seed_is_reproducible(client):
    options = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0,
               "seed": 7}
    first = client.completions.create(model=MODEL, **options).choices[0].text
    assert client.completions.create(model=MODEL, **options).choices[0].text == first


def test_chat_whole_and_streamed(client, tokenizer):
    options = {"messages": MESSAGES, "max_completion_tokens": 12, "temperature": 0.7,
               "seed": 99}
    whole = client.chat.completions.create(model=MODEL, **options)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               tokenize=True)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert 0 < whole.usage.completion_tokens <= 12

    chunks, text = _stream_chat(client, stream_options={"include_usage": True}, **options)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(whole.usage)


def test_chat_content_parts_and_max_tokens(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                             {"type": "text", "text": "hello."}]}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stop_string(client, api):
    def run(**kwargs):
        if api == "completions":
            resp = client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
            return resp.choices[0].text, resp.choices[0].finish_reason
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        return resp.choices[0].message.content, resp.choices[0].finish_reason

    options = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full, _ = run(**options)
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    text, reason = run(stop=[stop], **options)
    assert reason == "stop"
    assert text == full[: full.index(stop)]


def test_prompt_forms(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    options = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    by_text = client.completions.create(prompt=PROMPT, **options).choices[0].text
    by_ids = client.completions.create(prompt=ids, **options).choices[0].text
    assert by_ids == by_text
    many = client.completions.create(prompt=[PROMPT, "1, 2, 3,"], **options)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("1, 2, 3,"))
    many_ids = client.completions.create(prompt=[ids, ids], **options)
    assert [c.text for c in many_ids.choices] == [by_text, by_text]
    chunks, _ = _stream_completion(client, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4,
                                   temperature=0)
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: by_text, 1: many.choices[1].text}


def test_echo_prepends_the_prompt(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                     temperature=0)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert resp.choices[0].text == PROMPT + plain.choices[0].text


def test_n_choices(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, seed=3)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert 2 <= resp.usage.completion_tokens <= 8
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,
                                          seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    chunks, _ = _stream_chat(client, messages=MESSAGES, max_tokens=4, n=2, seed=3)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(x) for top, x in
               zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs(server, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}
    with server.http() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = tokenizer.encode(PROMPT)
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entries in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entries and entries[str(token_id)]["logprob"] <= 0


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          logprobs=True, top_logprobs=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.bytes == list(token.token.encode())
    chunks, _ = _stream_chat(client, messages=MESSAGES, max_tokens=5, logprobs=True,
                             top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_tokenize_detokenize_version_health(server, tokenizer):
    with server.http() as http:
        tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tok["tokens"] == tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
        assert tok["max_model_len"] > 0
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES, tokenize=True)
        detok = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
        assert detok["prompt"].strip() == PROMPT
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def keyed_server(smollm2_gguf, loaded_model):
    from tests.entrypoints.openai.conftest import run_server

    with run_server(smollm2_gguf, loaded_model, api_key="sekrit",
                    allowed_origins=("http://example.com",)) as running:
        yield running


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="wrong").models.list()
    with keyed_server.http() as http:
        missing = http.get("/v1/models")
        assert missing.status_code == 401
        assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
        no_key = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert no_key.status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    right = keyed_server.client(api_key="sekrit")
    assert [m.id for m in right.models.list().data] == [MODEL]
    resp = right.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert resp.usage.completion_tokens >= 1


def test_llmserve_serve_prints_url_and_exits_0_on_sigterm(smollm2_gguf):
    """`llmserve serve` in a subprocess: URL on stdout, /health, SIGTERM finishes in-flight."""
    import json
    import signal

    import httpx

    from tests.cli_server import cli_server

    args = ["--model", str(smollm2_gguf), "--port", "0", "--kv-cache-memory", "32MiB",
            "--max-model-len", "512"]
    with cli_server(args) as (proc, url):
        assert url.endswith("/v1") and "127.0.0.1" in url
        base = url.removesuffix("/v1")
        with httpx.Client(base_url=base, timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": "Once upon a time", "max_tokens": 24, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                events = resp.iter_lines()
                first = next(line for line in events if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in events if line.startswith("data:")]
        chunks = [json.loads(line[5:]) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0


def test_cors_off_by_default_and_configurable(server, keyed_server):
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    with server.http() as http:
        resp = http.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in resp.headers
    with keyed_server.http() as http:
        resp = http.options("/v1/completions", headers=preflight)
        assert resp.headers["access-control-allow-origin"] == "http://example.com"


def test_streamed_choices_add_up_to_the_whole_response(client):
    """n=2 streamed with a stop string and logprobs: each choice's chunks join up to that
    choice of the whole response (text, logprob tokens, finish reason), usage included."""
    options = {"prompt": "Once upon a time", "max_tokens": 16, "n": 2, "seed": 21,
               "temperature": 1.0, "logprobs": 1}
    first = client.completions.create(model=MODEL, **options).choices[0].text
    stop = first[len(first) // 2:][:4]
    assert stop.strip(), first
    whole = client.completions.create(model=MODEL, stop=[stop], **options)
    assert whole.choices[0].finish_reason == "stop"
    chunks, _ = _stream_completion(client, stop=[stop], stream_options={"include_usage": True},
                                   **options)
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = streamed.setdefault(c.index, {"text": "", "tokens": [], "finish": None})
            choice["text"] += c.text
            choice["tokens"] += c.logprobs.tokens if c.logprobs else []
            choice["finish"] = choice["finish"] or c.finish_reason
    assert streamed == {c.index: {"text": c.text, "tokens": c.logprobs.tokens,
                                  "finish": c.finish_reason} for c in whole.choices}
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
