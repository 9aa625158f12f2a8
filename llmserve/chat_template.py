"""Chat templates as transformers renders them, in a sandboxed jinja2 environment: they come
from model files, i.e. untrusted code."""

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmserve.errors import LLMServeError


class ChatTemplateError(LLMServeError):
    """The chat template cannot render these messages (or the model has no template)."""



class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers); for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def compile_chat_template(source: str) -> jinja2.Template:
    """Chat templates come from model files, i.e. untrusted code: render them sandboxed, with
    the same environment settings and helpers as transformers so prompts match exactly.

    The sandbox refuses the template Python's internals (`__class__`, `__globals__`, ...),
    unsafe callables and changes to the data passed in, and caps `range` at 100,000 items;
    it does not bound a render's time or memory (SECURITY.md)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template is invalid: {e}") from None
