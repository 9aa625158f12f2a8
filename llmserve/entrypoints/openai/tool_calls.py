"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask, and how tools
and earlier calls reach the chat template.

* tool_choice "none": no tools in the prompt, output is text.
* "auto" (the default with tools): the model answers text or calls tools in its chat
  template's format (a `ToolFormat`), read back by that format's extractor.
* "required" or a named function: enforced by a grammar on the output (a JSON schema),
  in a shape `tool_parsers` reads: the named function's arguments object, or an array of
  `{"name", "arguments"}` objects (exactly one with `parallel_tool_calls` false).

A template that does not render tools itself (SmolLM2's has no `tools` variable) gets them
the way its format's models are taught: a system prompt listing them, earlier calls written
into the assistant's text and results wrapped as the format wraps them.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ToolDefinition,
)
from llmserve.entrypoints.openai.structured import Constraint
from llmserve.entrypoints.openai.tool_parsers import (
    BareJsonCallExtractor,
    CallArrayExtractor,
    FirstCallOnly,
    NamedCallExtractor,
    TaggedCallExtractor,
    ToolCallExtractor,
)
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.tokenizer import Tokenizer

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolFormat:
    """How one family of chat templates writes tools, calls and results (Hermes/Qwen style
    by default); `extractor` reads the calls back out of generated text."""

    name = "hermes"
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")  # what the extractor looks for

    def matches(self, template: str) -> bool:
        return "<tool_call>" in template

    def extractor(self) -> ToolCallExtractor:
        return TaggedCallExtractor()

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{listing}\n</tools>\n\nFor each function call, return a "
                "json object with function name and arguments within <tool_call></tool_call>"
                " XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) + "\n</tool_call>"
            for c in calls)

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3Format(ToolFormat):
    """Llama 3.x JSON tool calling: `{"name": ..., "parameters": {...}}`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def matches(self, template: str) -> bool:
        return "<|python_tag|>" in template or "<|start_header_id|>" in template

    def extractor(self) -> ToolCallExtractor:
        return BareJsonCallExtractor()

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                "Respond in the format {\"name\": function name, \"parameters\": dictionary "
                f"of argument name and its value}}. Do not use variables.\n\n{listing}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"],
                                     "parameters": c["function"]["arguments"]},
                                    ensure_ascii=False) for c in calls)

    def result_text(self, content: str) -> str:
        return content


TOOL_FORMATS: tuple[ToolFormat, ...] = (Llama3Format(), ToolFormat())  # first match wins


def tool_format_for(template: str | None) -> ToolFormat:
    """The format a chat template teaches; Hermes' `<tool_call>` when it shows none."""
    return next((f for f in TOOL_FORMATS if f.matches(template or "")), TOOL_FORMATS[-1])


def markers_are_special(fmt: ToolFormat, tokenizer: Tokenizer) -> bool:
    """Whether the format's markers are special tokens of this model (Qwen's <tool_call>),
    which decoding drops unless told to keep them: the extractor must see them."""
    special = set(tokenizer.all_special_ids)
    return any(tokenizer.token_to_id(m) in special for m in fmt.markers)


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None, fmt: ToolFormat) -> list[dict[str, Any]]:
    """`messages` ready for a template that may not know tools: what it would drop (the tool
    list, assistant calls, tool results) written into the messages' text in `fmt`."""
    template = template or ""
    result = [dict(m) for m in messages]
    if "tool_calls" not in template:
        for m in result:
            if m["role"] == "assistant" and m.get("tool_calls"):
                m["content"] = "\n".join(t for t in (m["content"], fmt.calls_text(
                    m["tool_calls"])) if t)
            elif m["role"] == "tool":
                m["content"] = fmt.result_text(m["content"])
    if tools and not re.search(r"\btools\b", template):
        prompt = fmt.tools_prompt(tools)
        if result and result[0]["role"] == "system":
            result[0]["content"] = f"{result[0]['content']}\n\n{prompt}"
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result


@dataclass(frozen=True)
class ToolPlan:
    """What the tool fields ask of one chat request."""

    tools: list[dict[str, Any]] | None  # definitions shown in the prompt
    constraint: Constraint | None  # the grammar of "required" or a named function
    extractor: Callable[[], ToolCallExtractor] | None  # None: the output is plain text
    auto: bool = False  # the model chooses; its calls are read in the template's format


def plan_tools(request: ChatCompletionRequest, fmt: ToolFormat) -> ToolPlan:
    """The request's tool plan; a tool_choice that cannot be served is a 400 naming it."""
    tools = request.tools or []
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    if choice in ("none", "auto") and not tools:
        return ToolPlan(None, None, None)
    definitions = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(None, None, None)
    if choice == "auto":
        def first_call_only() -> ToolCallExtractor:
            return FirstCallOnly(fmt.extractor())

        extractor = fmt.extractor if request.parallel_tool_calls else first_call_only
        return ToolPlan(definitions, None, extractor, auto=True)
    if not tools:
        raise BadRequest("tool_choice other than 'none' or 'auto' needs tools",
                         param="tool_choice")
    if choice == "required":
        schema = _call_array_schema(tools, one=not request.parallel_tool_calls)
        return ToolPlan(definitions, _constraint(schema, "tools"), CallArrayExtractor)
    name = _named_function(choice)
    index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
    if index is None:
        raise BadRequest(f"tool_choice names the function '{name}', which is not in tools",
                         param="tool_choice")
    schema = tools[index].function.parameters or NO_PARAMETERS
    return ToolPlan(definitions, _constraint(schema, f"tools[{index}].function.parameters"),
                    lambda: NamedCallExtractor(name))


def _named_function(choice: Any) -> str:
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                         param="tool_choice")
    return name


def _call_array_schema(tools: list[ToolDefinition], one: bool) -> dict[str, Any]:
    """An array of one or more calls, each `{"name": <a tool>, "arguments": <its
    parameters>}`. Definitions ($defs) of the tools' schemas move to the root, where their
    `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            definitions = parameters.pop(key, {})
            if not isinstance(definitions, dict):
                raise BadRequest(f"'{key}' must be an object of named schemas",
                                 param=f"tools[{i}].function.parameters")
            for def_name, definition in definitions.items():
                if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise BadRequest(f"two tools define '{key}/{def_name}' differently; "
                                     "rename one", param=f"tools[{i}].function.parameters")
        calls.append({"type": "object",
                      "properties": {"name": {"const": tool.function.name},
                                     "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if one:
        schema["maxItems"] = 1
    return {**schema, **defs}


def _constraint(schema: dict[str, Any], schema_field: str) -> Constraint:
    # as text: properties are generated in the order the user wrote them
    return Constraint(StructuredOutputsParams(json=json.dumps(schema)), "tool_choice",
                      schema_field)
