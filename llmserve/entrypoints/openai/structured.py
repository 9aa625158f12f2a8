"""Request fields that constrain the output, turned into one `StructuredOutputsParams`.

Both routes take OpenAI's `response_format`, vLLM's `structured_outputs` object and vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; chat adds the
grammar behind `tool_choice` (tool_calls.py). A request sets at most one constraint; each
keeps the name of the field that set it, so that a schema the engine cannot compile is
refused with a 400 naming that field (`rename_engine_error`).
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from llmserve.entrypoints.openai.protocol import BadRequest, SamplingRequest
from llmserve.sampling_params import StructuredOutputsParams

GRAMMAR_BACKENDS = ("auto", "llguidance", "guidance")  # what guided_decoding_backend may ask

# keys of vLLM's structured_outputs object that are constraints (llmserve's names)
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """An output constraint and the request field that set it; `schema_field`, when the
    schema came from another field (tool_choice enforces tools' parameters), is the one
    named when the engine cannot compile it."""

    params: StructuredOutputsParams
    field: str
    schema_field: str | None = None

    @property
    def error_field(self) -> str:
        return self.schema_field or self.field


def request_constraints(request: SamplingRequest) -> list[Constraint]:
    """Every output constraint the request's own fields set (`response_format`,
    `structured_outputs`, `guided_*`), in that order; a malformed one is a `BadRequest`."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise BadRequest(f"guided_decoding_backend '{backend}' is not available; this server "
                         f"enforces constraints with llguidance ({', '.join(GRAMMAR_BACKENDS)})",
                         param="guided_decoding_backend")
    found = []
    if request.response_format is not None:
        found.append(_response_format(request.response_format))
    if request.structured_outputs is not None:
        found.append(_structured_outputs(request.structured_outputs))
    for name, key in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            found.append(Constraint(_params(name, **{key: _schema_text(value)}), name))
    return [c for c in found if c is not None]


def single_constraint(constraints: list[Constraint]) -> Constraint | None:
    """The one constraint, or None; two at once is a 400 naming both fields."""
    if len(constraints) > 1:
        names = [c.field for c in constraints]
        raise BadRequest(f"a request can set one output constraint; this one sets "
                         f"{' and '.join(names)}", param=names[1])
    return constraints[0] if constraints else None


def rename_engine_error(message: str, field: str) -> str:
    """The engine's refusal ("structured_outputs.json cannot be enforced: ...") in terms of
    the field the user set ("response_format cannot be enforced: ...")."""
    return re.sub(r"^structured_outputs(\.\w+)?", field, message, count=1)


def _response_format(response_format: dict[str, Any]) -> Constraint | None:
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    field = "response_format"
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(_params(field, json_object=True), field)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format of type 'json_schema' needs "
                             "json_schema.schema, a JSON schema object", param=field)
        # `strict` asks that the schema be enforced, which every schema here is
        return Constraint(_params(field, json=_schema_text(schema)), field)
    raise BadRequest(f"response_format type {kind!r} is not supported; use 'text', "
                     "'json_object' or 'json_schema'", param=field)


def _structured_outputs(spec: dict[str, Any]) -> Constraint:
    """vLLM's structured_outputs object; a key this server cannot honour is a 400."""
    field = "structured_outputs"
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if value is None:
            continue
        if key in _CONSTRAINT_KEYS:
            options[key] = _schema_text(value) if key == "json" else value
        elif key == "whitespace_flexible":
            options[key] = value
        elif key == "disable_any_whitespace":  # vLLM's switch, the other way round
            options["whitespace_flexible"] = not value
        elif key == "disable_fallback" or (key == "disable_additional_properties"
                                           and value is False):
            pass  # one backend, nothing to fall back from; False asks nothing
        else:
            raise BadRequest(f"{field}.{key} is not supported; give one of "
                             f"{', '.join(_CONSTRAINT_KEYS)}", param=field)
    return Constraint(_params(field, **options), field)


def _params(field: str, **options: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**options)
    except (ValueError, TypeError) as e:
        raise BadRequest(rename_engine_error(str(e), field), param=field) from None


def _schema_text(value: Any) -> Any:
    """A JSON schema as text, its properties in the user's order (the order they are
    generated in); anything else as it came."""
    return json.dumps(value) if isinstance(value, dict) else value
