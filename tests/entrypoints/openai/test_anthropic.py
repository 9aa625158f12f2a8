"""Anthropic's Messages API through the `anthropic` SDK against a live server: whole and
streamed answers equal the chat route's, tool use (grammar-enforced with `any`) and the
result's round trip, stop sequences, count_tokens, and errors in Anthropic's shape."""

import json

import pytest

from tests.entrypoints.openai.conftest import MODEL

GREEDY = {"temperature": 0}  # the SDK no longer sends sampling settings; the API takes them
QUESTION = [{"role": "user", "content": "Name three fruits."}]
SYSTEM = "You answer briefly."
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}


def sdk():
    """The `anthropic` SDK, imported on first use (not at collection: its import takes
    1.5 s of every test worker)."""
    return pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def claude(server):
    return sdk().Anthropic(base_url=server.url, api_key="none", max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def chat_answer(client) -> str:
    """The chat route's greedy answer to the same conversation."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
        max_tokens=24, extra_body=GREEDY)
    return reply.choices[0].message.content


def test_a_message_is_the_chat_answer(claude, chat_answer, client):
    message = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM,
                                     messages=QUESTION, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat_answer
    assert message.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    usage = message.usage  # the prompt is what was read from the prefix cache and the rest
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens > 0
    assert 0 < usage.output_tokens <= 24


def test_cached_tokens_are_counted_once_whole_and_streamed(claude):
    """Anthropic's `input_tokens` leaves out the cache reads that `cache_read_input_tokens`
    counts (the figures add up to the prompt), and a streamed answer says the same."""
    question = [{"role": "user", "content": "Tell me about the books in this library. " * 4}]
    counted = claude.messages.count_tokens(model=MODEL, messages=question).input_tokens
    claude.messages.create(model=MODEL, max_tokens=2, messages=question, extra_body=GREEDY)
    whole = claude.messages.create(model=MODEL, max_tokens=2, messages=question,
                                   extra_body=GREEDY).usage
    assert whole.cache_read_input_tokens > 0
    assert whole.input_tokens + whole.cache_read_input_tokens == counted
    with claude.messages.stream(model=MODEL, max_tokens=2, messages=question,
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message().usage
    assert (streamed.input_tokens, streamed.cache_read_input_tokens) == \
        (whole.input_tokens, whole.cache_read_input_tokens)


def test_a_streamed_message_is_the_whole_one(claude, chat_answer):
    events = []
    with claude.messages.stream(model=MODEL, max_tokens=24, system=SYSTEM,
                                messages=QUESTION, extra_body=GREEDY) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == chat_answer
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert events.index("message_delta") > events.index("content_block_stop")


def test_tool_use_is_enforced_and_its_result_goes_back(claude):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = claude.messages.create(model=MODEL, max_tokens=160, messages=question,
                                     tools=[WEATHER], tool_choice={"type": "any"},
                                     extra_body=GREEDY)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) >= 1 and message.stop_reason == "tool_use"
    call = calls[0]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    answer = claude.messages.create(
        model=MODEL, max_tokens=16, tools=[WEATHER], extra_body=GREEDY,
        messages=[*question, {"role": "assistant", "content": message.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": call.id,
                                                "content": "Sunny, 21 C."}]}])
    assert answer.content and answer.content[0].type in ("text", "tool_use")
    named = claude.messages.create(model=MODEL, max_tokens=160, messages=question,
                                   tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    assert [b.type for b in named.content] == ["tool_use"]


def test_a_streamed_tool_call_carries_its_input(claude):
    with claude.messages.stream(model=MODEL, max_tokens=160, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (call,) = final.content
    assert call.type == "tool_use" and isinstance(call.input["city"], str)
    assert final.stop_reason == "tool_use"


def test_a_stop_sequence_is_reported(claude, chat_answer):
    words = chat_answer.split()
    assert len(words) >= 3, chat_answer
    stop = " " + words[2]
    message = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM,
                                     messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == chat_answer[:chat_answer.index(stop)]


def test_an_output_format_shapes_the_answer(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    message = claude.messages.create(
        model=MODEL, max_tokens=48, extra_body=GREEDY,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(message.content[0].text)) == {"city"}
    with pytest.raises(sdk().BadRequestError) as effort:
        claude.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                               output_config={"effort": "high"})
    assert "effort" in effort.value.body["error"]["message"]


def test_errors_have_anthropic_shape(claude, server):
    with pytest.raises(sdk().NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "not_found_error"
    response = server.http().post("/v1/messages", json={"model": MODEL, "messages": QUESTION})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in response.json()["error"]["message"]
    with pytest.raises(sdk().BadRequestError) as thinking:
        claude.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in thinking.value.body["error"]["message"]
    with pytest.raises(sdk().BadRequestError) as image:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    assert "image" in image.value.body["error"]["message"]
