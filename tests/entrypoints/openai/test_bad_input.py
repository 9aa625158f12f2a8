"""Bad requests get 4xx in OpenAI's error shape naming the field; the server carries on."""

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 10)

# (path, body, status, field named in the message)
CASES = [
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": USER, "model": "no-such-model"}, 404, "model"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": USER, "stream": "maybe"}, 400, "stream"),
    (COMPLETIONS, {"prompt": LONG_PROMPT}, 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN * 4}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": MAX_MODEL_LEN * 4}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN * 4}, 400,
     "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"not-a-token": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "and then"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),  # a text model: no images
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400,
     "messages[0].content[0].type"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    # /tokenize and /detokenize refuse what they do not know: a dropped tokenizer option
    # would give other ids than asked for
    ("/tokenize", {"prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": USER, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": USER, "chat_template": "{{ messages }}"}, 400,
     "chat_template"),
    ("/detokenize", {"tokens": [1], "skip_special": True}, 400, "skip_special"),
    # found by contract fuzzing and probing: each was a 500 or named the wrong field
    (COMPLETIONS, {"prompt": [5, 2**40], "echo": True}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (CHAT, {"messages": USER, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    # fields of the OpenAI / vLLM APIs that are not served yet: refused, never dropped
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    (CHAT, {"messages": USER, "use_beam_search": True}, 400, "use_beam_search"),
    (COMPLETIONS, {"prompt": "hi", "guided_whitespace_pattern": " "}, 400,
     "guided_whitespace_pattern"),
    (CHAT, {"messages": USER, "guided_decoding_backend": "xgrammar"}, 400,
     "guided_decoding_backend"),
    (COMPLETIONS, {"prompt": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "guided_json": {"type": "foo"}}, 400, "guided_json"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    (COMPLETIONS, {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (CHAT, {"messages": USER, "length_penalty": 0.5}, 400, "length_penalty"),
]


def _check_error(resp: httpx.Response, status: int, field: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if field is not None:
        assert field in error["message"], error
        assert error["param"] in (field, None), error
    return error


@pytest.mark.parametrize(("path", "body", "status", "field"), CASES,
                         ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)])
def test_bad_request(server, path, body, status, field):
    with server.http() as http:
        _check_error(http.post(path, json=body), status, field)


def test_invalid_json_and_non_object_body(server):
    with server.http() as http:
        headers = {"content-type": "application/json"}
        error = _check_error(http.post(COMPLETIONS, content=b'{"prompt": "hi",', headers=headers),
                             400, None)
        assert "JSON" in error["message"]
        _check_error(http.post(CHAT, content=b"[1, 2]", headers=headers), 400, None)


def test_body_too_large(server):
    huge = {"prompt": "a" * (server_limit(server) + 10)}
    with server.http() as http:
        _check_error(http.post(COMPLETIONS, json=huge), 413, None)


def server_limit(server) -> int:
    from llmserve.entrypoints.openai.server import DEFAULT_MAX_REQUEST_BYTES

    return DEFAULT_MAX_REQUEST_BYTES


def test_unknown_route_and_fields(server):
    with server.http() as http:
        _check_error(http.get("/v1/nothing-here"), 404, None)
        ok = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2,
                                          "some_future_field": 1})
        assert ok.status_code == 200, ok.text


def test_still_serves_after_bad_requests(server, client):
    with server.http() as http:
        for path, body, status, _ in CASES:
            assert http.post(path, json=body).status_code == status
    resp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4)
    assert resp.usage.completion_tokens >= 1
    assert not server.engine.engine.has_unfinished_requests()


def test_a_failing_step_fails_its_requests_not_the_server(server, client):
    engine = server.engine.engine
    real_step = engine.step

    def failing_step():
        del engine.step  # fail once, then the real step again
        raise RuntimeError("injected failure")

    engine.step = failing_step
    try:
        with server.http() as http:
            resp = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 4})
        assert resp.status_code == 500
        assert "injected failure" in resp.json()["error"]["message"]
    finally:
        engine.__dict__.pop("step", None)
    assert engine.step == real_step
    assert not engine.has_unfinished_requests()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_no_op_values_of_unsupported_fields_and_unknown_fields_are_served(server):
    """Values that change nothing (use_beam_search false, tool_choice auto, a text
    response_format) and fields nobody defines are served as usual."""
    body = {"messages": USER, "max_tokens": 2, "use_beam_search": False, "tool_choice": "auto",
            "length_penalty": 1.0, "response_format": {"type": "text"}, "my_client_tag": 7}
    with server.http() as http:
        assert http.post(CHAT, json=body).status_code == 200
        plain = {"prompt": "hi", "max_tokens": 2, "guided_regex": None,
                 "response_format": {"type": "text"}}
        assert http.post(COMPLETIONS, json=plain).status_code == 200


# Templates as models ship them: Gemma's refuses a system turn, others refuse what they
# cannot format; a template can also fail on its own (a type error, a range too big).
REJECTING_TEMPLATES = [
    ("{% for m in messages %}{% if m['role'] == 'system' %}"
     "{{ raise_exception('System role not supported') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", "System role not supported"),
    ("{% for m in messages %}{{ m['content'] + loop.index }}{% endfor %}", "TypeError"),
    ("{% for i in range(10 ** 10) %}{{ i }}{% endfor %}", "OverflowError"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
]


@contextmanager
def chat_template(tokenizer, source: str) -> Iterator[None]:
    """The served model's chat template replaced by `source` (restored on exit)."""
    saved = tokenizer.chat_template
    tokenizer.__dict__.pop("_compiled_template", None)  # cached_property
    tokenizer.chat_template = source
    try:
        yield
    finally:
        tokenizer.chat_template = saved
        tokenizer.__dict__.pop("_compiled_template", None)


@pytest.mark.parametrize(("template", "reason"), REJECTING_TEMPLATES,
                         ids=["raise_exception", "type_error", "huge_range", "sandbox"])
def test_a_template_that_fails_is_that_requests_400(server, client, template, reason):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with chat_template(server.engine.tokenizer, template), server.http() as http:
        for path, body in ((CHAT, {"max_tokens": 2}), ("/tokenize", {})):
            error = _check_error(http.post(path, json={"messages": messages, **body}),
                                 400, "messages")
            assert error["param"] == "messages" and reason in error["message"], error
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert not server.engine.engine.has_unfinished_requests()


def test_chat_template_kwargs_cannot_replace_the_requests_variables(server):
    with server.http() as http:
        for name in ("messages", "tools", "add_generation_prompt"):
            body = {"messages": USER, "chat_template_kwargs": {name: []}}
            error = _check_error(http.post(CHAT, json=body), 400, "chat_template_kwargs")
            assert name in error["message"]
        ok = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"bos_token": "<s>"}}
        assert http.post(CHAT, json=ok).status_code == 200


def test_lone_surrogates_are_400s_naming_where(server):
    """JSON can spell a lone surrogate ("\\ud800"); the Rust tokenizer cannot take one (it
    was a 500 from chat)."""
    tool = ('{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
            '"description": "\\ud800"}}}')
    bodies = [
        (CHAT, '{"messages": [{"role": "user", "content": "a\\udc00b"}]}', "messages[0].content"),
        (COMPLETIONS, '{"prompt": ["ok", "\\ud800"]}', "prompt[1]"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}",
         "messages"),
    ]
    with server.http() as http:
        for path, body, field in bodies:
            resp = http.post(path, content=body.encode(),
                             headers={"Content-Type": "application/json"})
            assert _check_error(resp, 400, field)["param"] == field


def test_tokenize_honours_what_it_accepts(server, tokenizer):
    assistant = [*USER, {"role": "assistant", "content": "Hello the"}]
    with server.http() as http:
        continued = http.post("/tokenize", json={
            "messages": assistant, "add_generation_prompt": False,
            "continue_final_message": True}).json()["tokens"]
        closed = http.post("/tokenize", json={
            "messages": assistant, "add_generation_prompt": False}).json()["tokens"]
        strs = http.post("/tokenize", json={"prompt": "Hello world",
                                            "return_token_strs": True}).json()
    assert tokenizer.decode(continued).endswith("Hello the")
    assert len(closed) > len(continued) and closed[:len(continued)] == continued
    assert strs["token_strs"] == [tokenizer.id_to_token(i) for i in strs["tokens"]]


def test_a_refused_unknown_key_is_named_whatever_it_holds(server):
    """/tokenize refuses keys it does not define; a key with brackets or a dash in it (as
    the fuzzer sent: "Ni\\x05A...([...\\b") is named as written, not taken for a union
    branch's name and dropped (which left "the request body must be a JSON object")."""
    with server.http() as http:
        for key in ("a[0]-b", "([\U00024098\b"):
            error = _check_error(http.post("/tokenize", json={"prompt": "hi", key: 1}), 400,
                                 key)
            assert error["param"] == key


def test_a_refused_field_is_not_logged_as_ignored(server, caplog):
    """A field the route refuses gets its 400, not also an "ignoring" line in the log; a
    field nobody defines is logged as ignored."""
    import logging

    with caplog.at_level(logging.INFO, logger="llmserve.entrypoints.openai.protocol"), \
            server.http() as http:
        refused = http.post(CHAT, json={"messages": USER, "use_beam_search": True})
        served = http.post(CHAT, json={"messages": USER, "max_tokens": 1, "my_tag": 1})
    assert refused.status_code == 400 and served.status_code == 200
    logged = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert logged == ["ignoring unknown request fields: 'my_tag'"]
