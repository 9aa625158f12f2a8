"""Tool calling: parsers on literal text in both template styles (milliseconds), then the
server through the official client: required and named choices enforced (sampled, whole and
streamed), auto, a call -> result -> answer conversation, and the 400s."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from llmserve.entrypoints.openai.tool_calls import (
    Llama3Format,
    ToolFormat,
    markers_are_special,
    template_messages,
    tool_format_for,
)
from llmserve.entrypoints.openai.tool_parsers import (
    BareJsonCallExtractor,
    CallArrayExtractor,
    Extracted,
    NamedCallExtractor,
    TaggedCallExtractor,
)
from tests.entrypoints.openai.conftest import MODEL

# ---- parsers on literal strings --------------------------------------------------------


def _extract(extractor, text: str, step: int) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of `text` fed `step` characters at a time."""
    out = Extracted()
    for i in range(0, len(text), step):
        out += extractor.feed(text[i:i + step])
    out += extractor.finish()
    calls: dict[int, list] = {}
    for piece in out.tool_calls:
        if piece.id is not None:
            assert piece.id.startswith("call_") and piece.index not in calls
            calls[piece.index] = [piece.name, ""]
        calls[piece.index][1] += piece.arguments
    return out.content, [(name, json.loads(args)) for name, args in calls.values()]


HERMES_CASES = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "", [("add", {"a": 1, "b": 2})]),
    ('Let me check. <tool_call>{"name": "f", "arguments": {"s": "</tool_call"}}</tool_call>'
     '\n<tool_call>{"name": "g", "arguments": "{\\"x\\": [1]}"}</tool_call>',
     "Let me check.", [("f", {"s": "</tool_call"}), ("g", {"x": [1]})]),
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"k": 1}}]'
     '</tool_call>', "", [("a", {}), ("b", {"k": 1})]),
    ('<tool_call>{"name": "f", "arguments": {"q": "x"}}', "", [("f", {"q": "x"})]),
    ("1 < 2 and <tool_call>not json</tool_call> done",
     "1 < 2 and <tool_call>not json</tool_call> done", []),
    ("just text, no calls <tool_", "just text, no calls <tool_", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
     []),
]


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_tagged_calls(text, content, calls, step):
    assert _extract(TaggedCallExtractor(), text, step) == (content, calls)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"n": 2}}',
     "", [("a", {}), ("b", {"n": 2})]),
    ('  [{"name": "a", "parameters": {"x": true}}]', "", [("a", {"x": True})]),
    ("The weather is sunny.", "The weather is sunny.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {"x": 1}', []),
]


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_calls(text, content, calls, step):
    assert _extract(BareJsonCallExtractor(), text, step) == (content, calls)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_enforced_shapes(step):
    array = ('[{"name": "f", "arguments": {"s": "}]\\"{"}}, '
             '{"name": "g", "arguments": {"n": [1, {"m": 2}]}}]')
    assert _extract(CallArrayExtractor(), array, step) == (
        "", [("f", {"s": '}]"{'}), ("g", {"n": [1, {"m": 2}]})])
    cut = '[{"name": "f", "arguments": {}}, {"name": "g", "argu'
    assert _extract(CallArrayExtractor(), cut, step) == ('{"name": "g", "argu', [("f", {})])
    assert _extract(NamedCallExtractor("f"), '{"a": [1, 2]}', step) == ("", [("f", {"a": [1, 2]})])


def test_named_call_streams_its_arguments():
    extractor = NamedCallExtractor("f")
    first = extractor.feed('{"a"')
    assert first.tool_calls[0].to_json() == {
        "index": 0, "id": first.tool_calls[0].id, "type": "function",
        "function": {"name": "f", "arguments": '{"a"'}}
    assert extractor.feed(": 1}").tool_calls[0].to_json() == {
        "index": 0, "function": {"arguments": ": 1}"}}


LLAMA31_TEMPLATE = ("{{- '<|start_header_id|>' }}{%- if tools %}{{ tools | tojson }}{% endif %}"
                    "{%- for tool_call in message.tool_calls %}<|python_tag|>{% endfor %}")
QWEN_TEMPLATE = ("{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
                 "{%- endif %}{%- for tool_call in message.tool_calls %}<tool_call>{% endfor %}")
CHATML = "{% for message in messages %}<|im_start|>{{ message['content'] }}{% endfor %}"


def test_format_is_chosen_from_the_template(tokenizer):
    assert isinstance(tool_format_for(LLAMA31_TEMPLATE), Llama3Format)
    assert type(tool_format_for(QWEN_TEMPLATE)) is ToolFormat
    assert type(tool_format_for(CHATML)) is ToolFormat
    assert type(tool_format_for(None)) is ToolFormat
    assert type(tool_format_for(tokenizer.chat_template)) is ToolFormat  # SmolLM2


class _FakeTokenizer:
    """Qwen-like: <tool_call> and </tool_call> are special tokens."""

    all_special_ids = [7, 8]

    def token_to_id(self, token):
        return {"<tool_call>": 7, "</tool_call>": 8, "<|python_tag|>": 3}.get(token)


def test_markers_that_are_special_tokens_are_kept(tokenizer):
    assert markers_are_special(ToolFormat(), _FakeTokenizer())
    assert not markers_are_special(Llama3Format(), _FakeTokenizer())
    assert not markers_are_special(ToolFormat(), tokenizer)  # SmolLM2: plain text


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 30},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            "safe": {"type": "boolean"}},
            "required": ["query"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


@pytest.mark.parametrize("fmt", [ToolFormat(), Llama3Format()], ids=["hermes", "llama3"])
def test_template_without_tools_gets_them_written_in(fmt):
    """What a template cannot render is written in `fmt`, and reads back as the same call."""
    messages = template_messages(HISTORY, TOOLS, CHATML, fmt)
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assistant = messages[2]
    content, calls = _extract(fmt.extractor(), assistant["content"], 1000)
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert '{"temp": 21}' in messages[3]["content"] and messages[3]["role"] == "tool"
    assert HISTORY[1]["content"] == ""  # the caller's messages are left as they were


def test_template_with_tools_renders_them_itself():
    assert template_messages(HISTORY, TOOLS, QWEN_TEMPLATE, ToolFormat()) == HISTORY


# ---- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_server(smollm2_gguf, loaded_model):
    """A server (sharing the loaded weights) whose context fits three tools' definitions
    (~430 prompt tokens) and the calls."""
    from tests.entrypoints.openai.conftest import run_server

    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"max_model_len": 1024}) as running:
        yield running


@pytest.fixture(scope="module")
def long_client(long_server):
    return long_server.client()


MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


def _check_calls(calls, names=None) -> list[tuple[str, dict]]:
    """Every call is OpenAI-shaped and its arguments validate against its parameters."""
    assert calls, "no tool calls"
    result = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or PARAMETERS)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        result.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return result


def _streamed_calls(chunks):
    """The tool calls a stream's deltas add up to, and its last finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function"
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name,
                                          "arguments": ""}
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize(("tool_choice", "parallel"), [("required", False), ("required", True),
                                                       (NAMED, True)],
                         ids=["required-one", "required-parallel", "named"])
def test_enforced_tool_calls(long_client, tool_choice, parallel):
    """Two seeds, each whole and streamed: the four requests at once (the server batches
    them; a seeded request's tokens do not depend on its batch)."""
    names = ["add"] if tool_choice is NAMED else None

    def ask(seed: int, stream: bool):
        reply = long_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200,
            stream=stream)
        return list(reply) if stream else reply

    with ThreadPoolExecutor(4) as pool:
        asked = {(seed, stream): pool.submit(ask, seed, stream)
                 for seed in (1, 2) for stream in (False, True)}
    for seed in (1, 2):
        choice = asked[seed, False].result().choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.role == "assistant"
        calls = _check_calls(choice.message.tool_calls, names)
        if not parallel:
            assert len(calls) == 1
        streamed, finish = _streamed_calls(asked[seed, True].result())
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls


def test_required_with_definitions_shared_by_reference(long_client):
    """Each tool's $defs move to the root of the call-array schema, where $ref points."""
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["x"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
        "additionalProperties": False, "$defs": {"Point": point}}}} for name in ("f", "g")]
    resp = long_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=60)
    (call,) = resp.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments)["p"], point)
    assert resp.choices[0].finish_reason == "tool_calls"


def test_named_choice_streams_arguments_in_pieces(long_client):
    chunks = list(long_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=1.0,
        seed=3, max_tokens=100, stream=True))
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 1
    first = pieces[0].choices[0].delta.tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "add"
    assert all(p.choices[0].delta.tool_calls[0].id is None for p in pieces[1:])


def test_auto_answers_text_or_calls(long_client):
    def ask(seed: int):
        return long_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=60).choices[0]

    with ThreadPoolExecutor(3) as pool:  # batched by the server
        choices = list(pool.map(ask, range(3)))
    for choice in choices:
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls)
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_auto_stream_and_whole_agree(long_client):
    options = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
               "temperature": 1.0, "seed": 8, "max_tokens": 40, "n": 2}
    with ThreadPoolExecutor(2) as pool:  # batched by the server
        asked = pool.submit(long_client.chat.completions.create, **options)
        streamed = pool.submit(lambda: list(long_client.chat.completions.create(
            stream=True, **options)))
    whole, chunks = asked.result(), streamed.result()
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == (choice.message.content or "")
        assert mine[-1].finish_reason == choice.finish_reason
        assert bool(choice.message.tool_calls) == any(c.delta.tool_calls for c in mine)


def test_call_result_answer_conversation(long_client, long_server, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = long_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=100, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = long_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
    # the prompt carried the call and its result, in the format the model reads
    with long_server.http() as http:
        ids = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    prompt = tokenizer.decode(ids["tokens"])
    arguments = json.loads(call.function.arguments)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}' \
        in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    assert '"description": "Search the web"' in prompt


def test_tool_choice_none_leaves_the_prompt_and_output_plain(client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="none", max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice",
     "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools", "foo"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", "foo"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name", "name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
]


@pytest.mark.parametrize(("extra", "param", "word"), BAD,
                         ids=[f"{b[1]}:{i}" for i, b in enumerate(BAD)])
def test_bad_tool_requests(server, extra, param, word):
    with server.http() as http:
        resp = http.post(CHAT, json={"messages": USER, "max_tokens": 4, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and word in error["message"], error


@pytest.mark.parametrize("extra", [{"tools": TOOLS}, {"tool_choice": "required"}])
def test_completions_refuse_tools(server, extra):
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == next(iter(extra))
