"""Structured output over HTTP: response_format, structured_outputs and guided_* on both
routes, sampled (temperature 1), whole and streamed; the output always matches; bad
constraints are 400s naming the field that set them."""

import json
import re

import jsonschema
import pydantic
import pytest

from tests.entrypoints.openai.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "A person, as JSON:"

# bounded schemas: every output completes well within max_tokens
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
TAGS = {"type": "array", "minItems": 1, "maxItems": 3, "items": {
    "type": "object", "properties": {"tag": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                     "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["tag", "score"], "additionalProperties": False}}
NESTED = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 10}]},
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                     "maximum": 9},
                                               "y": {"type": "integer", "minimum": -9,
                                                     "maximum": 9}},
              "required": ["x", "y"], "additionalProperties": False}},
    "required": ["ok", "note", "point"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "tags": TAGS, "nested": NESTED}
SAMPLING = {"temperature": 1.0, "max_tokens": 120}
# free-form JSON at temperature 1: many samples open a string the model never closes
# (the chat route's seeds 11, 12, 13 and 15 did once draws inverted the cumulative
# distribution), so the seed is one whose object closes within 200 tokens on both routes;
# a change to how the sampler draws moves every seed's sample
JSON_SEED = 14


def _chat(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish_reason) of one chat choice, streamed or whole."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kwargs)
              if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0]\
        .finish_reason


def _complete(client, stream: bool, **kwargs) -> tuple[str, str]:
    if not stream:
        choice = client.completions.create(model=MODEL, **kwargs).choices[0]
        return choice.text, choice.finish_reason
    chunks = [c for c in client.completions.create(model=MODEL, stream=True, **kwargs)
              if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def _run(client, route: str, stream: bool, **kwargs) -> tuple[str, str]:
    if route == "chat":
        return _chat(client, stream, messages=MESSAGES, **kwargs)
    if "response_format" in kwargs:  # not in the client's completions signature
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}),
                                "response_format": kwargs.pop("response_format")}
    return _complete(client, stream, prompt=PROMPT, **kwargs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema(client, name, route, stream):
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema",
                       "json_schema": {"name": name, "schema": schema, "strict": True}}
    text, finish = _run(client, route, stream, response_format=response_format,
                        seed=len(name) + stream, **SAMPLING)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_stream_and_whole_give_the_same_json_for_a_seed(client):
    options = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "p", "schema": PERSON}},
               "seed": 5, **SAMPLING}
    for route in ("chat", "completions"):
        assert _run(client, route, False, **options) == _run(client, route, True, **options)


def test_properties_come_in_the_schema_order(client):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"},
                                               "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    text, _ = _chat(client, False, messages=MESSAGES, seed=3, **SAMPLING,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "z", "schema": schema}})
    assert list(json.loads(text)) == ["zeta", "alpha"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_response_format_json_object(client, route, stream):
    text, finish = _run(client, route, stream, response_format={"type": "json_object"},
                        seed=JSON_SEED, temperature=1.0, max_tokens=200)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_guided_regex(client, route, stream):
    pattern = r"\d{3}-\d{3}-\d{4}"
    text, finish = _run(client, route, stream, seed=1, **SAMPLING,
                        extra_body={"guided_regex": pattern})
    assert finish == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_guided_choice_and_json(client, route):
    choices = ["red", "green", "blue"]
    for seed in range(4):
        text, finish = _run(client, route, seed % 2 == 1, seed=seed, **SAMPLING,
                            extra_body={"guided_choice": choices})
        assert finish == "stop" and text in choices, text
    text, finish = _run(client, route, False, seed=1, **SAMPLING,
                        extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(text), PERSON)


LARK = r"""
start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[a-z]{1,8}/
"""
GBNF = r"""
root ::= "yes" | "no" | "maybe " [0-9]
"""


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("grammar", "pattern"), [(LARK, r"(hello|hi) [a-z]{1,8}!"),
                                                  (GBNF, r"yes|no|maybe [0-9]")],
                         ids=["lark", "gbnf"])
def test_guided_grammar(client, route, grammar, pattern):
    for stream in (False, True):
        text, finish = _run(client, route, stream, seed=7, **SAMPLING,
                            extra_body={"guided_grammar": grammar})
        assert finish == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize(("spec", "check"), [
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"json": json.dumps(TAGS)}, lambda t: jsonschema.validate(json.loads(t), TAGS)),
    ({"json_object": True}, lambda t: json.loads(t).keys()),
    ({"regex": r"[A-Z][a-z]{2,6}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}", t).group()),
    ({"choice": ["yes", "no"]}, lambda t: ["yes", "no"].index(t)),
    ({"grammar": LARK}, lambda t: re.fullmatch(r"(hello|hi) [a-z]{1,8}!", t).group()),
], ids=["json", "json-text", "json_object", "regex", "choice", "grammar"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_structured_outputs_object(client, route, spec, check):
    text, finish = _run(client, route, False, seed=JSON_SEED, temperature=1.0, max_tokens=200,
                        extra_body={"structured_outputs": spec})
    assert finish == "stop", text
    check(text)


def test_flexible_whitespace_and_n_choices(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=9, **SAMPLING,
        extra_body={"structured_outputs": {"json": PERSON, "whitespace_flexible": True},
                    "guided_decoding_backend": "llguidance"})
    assert len(resp.choices) == 2
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_text_format_and_null_fields_constrain_nothing(server):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with server.http() as http:
        plain = http.post("/v1/chat/completions", json=body).json()
        same = http.post("/v1/chat/completions", json={
            **body, "response_format": {"type": "text"}, "guided_json": None,
            "structured_outputs": None, "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"] == same["choices"][0]["message"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_SCHEMA = {"type": "foo"}
# (route, extra body, param, words the message must carry)
BAD = [
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "guided_regex", ["response_format", "guided_regex"]),
    (COMPLETIONS, {"guided_json": PERSON, "guided_choice": ["a"]}, "guided_choice",
     ["guided_json", "guided_choice"]),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+"}, "guided_grammar": LARK},
     "guided_grammar", ["structured_outputs", "guided_grammar"]),
    (COMPLETIONS, {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs", ["regex", "choice"]),
    (CHAT, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format", ["foo"]),
    (COMPLETIONS, {"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format", ["foo"]),
    (CHAT, {"guided_json": BAD_SCHEMA}, "guided_json", ["foo"]),
    (COMPLETIONS, {"guided_json": "{not json"}, "guided_json", ["guided_json"]),
    (CHAT, {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs", ["foo"]),
    (COMPLETIONS, {"guided_regex": "[a-"}, "guided_regex", ["unclosed character class"]),
    (CHAT, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", ["regex"]),
    (COMPLETIONS, {"guided_grammar": "start: nothing_here"}, "guided_grammar",
     ["nothing_here"]),
    (CHAT, {"guided_choice": []}, "guided_choice", ["non-empty"]),
    (CHAT, {"guided_decoding_backend": "xgrammar", "guided_regex": "a+"},
     "guided_decoding_backend", ["xgrammar"]),
    (COMPLETIONS, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     ["outlines"]),
    (COMPLETIONS, {"guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern",
     ["whitespace_flexible"]),
    (CHAT, {"structured_outputs": {"json": PERSON, "whitespace_pattern": " "}},
     "structured_outputs", ["whitespace_pattern"]),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", ["schema"]),
    (COMPLETIONS, {"response_format": {"type": "yaml"}}, "response_format", ["yaml"]),
]


@pytest.mark.parametrize(("path", "extra", "param", "words"), BAD,
                         ids=[f"{b[2]}:{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_field(server, path, extra, param, words):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    with server.http() as http:
        resp = http.post(path, json={**body, "max_tokens": 8, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error


def test_server_serves_after_refused_constraints(server, client):
    with server.http() as http:
        for path, extra, _, _ in BAD:
            body = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
            assert http.post(path, json={**body, **extra}).status_code == 400
    assert not server.engine.engine.has_unfinished_requests()
    text, _ = _complete(client, False, prompt=PROMPT, max_tokens=30, seed=1,
                        extra_body={"guided_choice": ["x", "y"]})
    assert text in ("x", "y")


def test_openai_client_parse_helper(client):
    """The client's own structured-output helper (a pydantic model as response_format)."""
    class Point(pydantic.BaseModel):
        x: int
        y: int

    resp = client.chat.completions.parse(model=MODEL, messages=MESSAGES,
                                         response_format=Point, seed=2, **SAMPLING)
    point = resp.choices[0].message.parsed
    assert isinstance(point, Point)
