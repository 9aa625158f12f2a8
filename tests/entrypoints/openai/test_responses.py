"""OpenAI's Responses API through the `openai` SDK against a live server: text equal to the
chat route's, streamed events adding up to the whole response, a function tool and its
output's round trip, previous_response_id, store: false, and a JSON schema format."""

import json

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


def test_text_input_gives_the_chat_answer(client):
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."}])
    response = client.responses.create(model=MODEL, instructions="Be brief.",
                                       input="Name a colour.", max_output_tokens=16,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected


def test_the_stream_adds_up_to_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input="Name two rivers.",
                                    max_output_tokens=20, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Name two rivers.",
                                          max_output_tokens=20, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_and_its_output_round_trip(client):
    question = "What is the weather in Paris?"
    response = client.responses.create(model=MODEL, input=question, tools=[WEATHER],
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=160)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=16,
        input=[{"role": "user", "content": question}, calls[0].model_dump(),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C."}])
    assert follow.output and follow.status in ("completed", "incomplete")
    streamed = list(client.responses.create(model=MODEL, input=question, tools=[WEATHER],
                                            tool_choice={"type": "function",
                                                         "name": "get_weather"},
                                            temperature=0, max_output_tokens=160,
                                            stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in streamed
                     if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas
    assert isinstance(json.loads(deltas)["city"], str)


def test_previous_response_id_continues_the_conversation(client, tokenizer):
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, temperature=0,
                                     max_output_tokens=8)
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                    max_output_tokens=8)
    # the stored turn is in the prompt: user, assistant's answer, the new question
    assert second.usage.input_tokens > alone.usage.input_tokens + 5
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=MODEL, input="Hi", store=False,
                                       max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Again", previous_response_id=unstored.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_a_json_schema_format_shapes_the_text(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="A city and its country.", max_output_tokens=160, temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                         "strict": True}})
    value = json.loads(response.output_text)
    assert set(value) == {"city", "country"}


def test_what_is_not_served_is_refused_by_name(client):
    for field, value in (("background", True), ("reasoning", {"effort": "high"}),
                         ("include", ["reasoning.encrypted_content"])):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                    extra_body={field: value})
        assert refused.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as web:
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert web.value.body["param"] == "tools[0].type"


def test_errors_name_the_responses_fields(server):
    """A chat-side refusal names the Responses field that became the chat one (the slow
    fuzzer's find: a huge max_output_tokens was a 400 naming max_tokens)."""
    with server.http() as http:
        reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                 "max_output_tokens": 10**9})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "max_output_tokens"
    assert "max_output_tokens" in error["message"] and "max_tokens " not in error["message"]
