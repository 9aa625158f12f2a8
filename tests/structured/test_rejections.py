"""Constraints that cannot be enforced are refused when the request is added, with a
`ValueError` naming the field, and leave nothing behind in the engine."""

import pytest

from llmserve import LLM
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine, RequestRejected
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams

REJECTED_AT_ADD = {
    "unknown type": ("json", {"json": {"type": "foo"}}),
    "schema text that is not JSON": ("json", {"json": '{"type": "object",'}),
    "unsupported keyword": ("json", {"json": {"type": "array", "uniqueItems": True}}),
    # allOf of a closed object and one requiring another property: nothing satisfies both
    "unsatisfiable schema": ("json", {"json": {"allOf": [
        {"type": "object", "properties": {"name": {"type": "string"}},
         "additionalProperties": False},
        {"required": ["department"]}]}}),
    "regex with an unclosed group": ("regex", {"regex": "(ab"}),
    "regex with an unclosed class": ("regex", {"regex": "[a-"}),
    "lark syntax error": ("grammar", {"grammar": "start: (\"a\" | \"b\""}),
    "lark undefined rule": ("grammar", {"grammar": "start: greeting name"}),
    "gbnf syntax error": ("grammar", {"grammar": 'root ::= ("a" | "b"'}),
    "gbnf undefined rule": ("grammar", {"grammar": 'root ::= "hi " name'}),
}


@pytest.mark.parametrize("kind, fields", REJECTED_AT_ADD.values(), ids=list(REJECTED_AT_ADD))
def test_invalid_constraint_is_rejected_at_add(structured_engine, kind, fields):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
    with pytest.raises(RequestRejected) as caught:
        structured_engine.add_request("Hello", params)
    assert str(caught.value).startswith(f"structured_outputs.{kind}")
    assert not structured_engine.has_unfinished_requests()


@pytest.mark.parametrize("kind, fields", [REJECTED_AT_ADD["regex with an unclosed group"],
                                          REJECTED_AT_ADD["gbnf syntax error"]],
                         ids=["regex", "gbnf"])
def test_a_rejected_prompt_aborts_its_batch(structured_engine, kind, fields):
    # an engine of its own: if the batch's first request leaked, the shared one is unharmed
    config = EngineConfig(kv_cache_memory="32MiB")
    llm = LLM.from_engine(Engine(config, loaded=structured_engine.loaded))
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
    with pytest.raises(ValueError, match=rf"^prompt 1: structured_outputs\.{kind}"):
        llm.generate(["Is it?", "Is it?"], [good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate(["Is it?"], good, use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("fields, message", [
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": "  "}, "structured_outputs.grammar must be a non-empty string"),
    ({"json": ["not", "a", "schema"]}, "structured_outputs.json must be a JSON schema"),
    ({}, "structured_outputs needs exactly one of .*; got none"),
    ({"json": {"type": "object"}, "regex": "[a-z]+"},
     "structured_outputs needs exactly one of .*; got json, regex"),
    ({"choice": ["a"], "json_object": True},
     "structured_outputs needs exactly one of .*; got choice, json_object"),
], ids=["empty choice", "empty choice string", "empty regex", "blank grammar", "json list",
        "no constraint", "json and regex", "choice and json_object"])
def test_malformed_params_are_refused_at_construction(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_beam_search_refuses_a_constraint():
    with pytest.raises(ValueError, match="structured_outputs is not supported with beam"):
        SamplingParams(use_beam_search=True, beam_width=2,
                       structured_outputs=StructuredOutputsParams(choice=["a", "b"]))


def test_params_from_a_dict_are_validated_too():
    """The server passes `structured_outputs` as a JSON object."""
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SamplingParams(structured_outputs={"choice": []})
