"""Tool calls out of generated text, fed piece by piece as a stream produces it.

An extractor splits one choice's output into content and tool calls. The same extractor
serves a whole response (all the text, then `finish`) and a stream (each delta as it
comes), so both show the same calls. Three output shapes are read:

* what the grammar of `tool_choice` makes the model write (tool_calls.py): a named
  function's arguments object (`NamedCallExtractor`), or for "required" a JSON array of
  `{"name": ..., "arguments": {...}}` (`CallArrayExtractor`);
* what a chat template teaches the model to write when it may choose (`tool_choice` auto),
  one family per `ToolFormat` (tool_calls.py, which renders the prompt side):
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes, Qwen, SmolLM2;
  `TaggedCallExtractor`) or Llama 3's bare `{"name": ..., "parameters": ...}`, perhaps
  after `<|python_tag|>` (`BareJsonCallExtractor`). Text that does not parse as calls
  stays content.
"""

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call, as `delta.tool_calls[i]` streams it: the first piece of a
    call carries its id and name; `arguments` pieces join up to the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_json(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        piece: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            piece.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        return {**piece, "function": function}


@dataclass
class Extracted:
    """What an extractor lets out at one point: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: "Extracted") -> "Extracted":
        return Extracted(self.content + other.content, self.tool_calls + other.tool_calls)


class ToolCallExtractor(ABC):
    """Splits one choice's output text, fed as it is generated, into content and calls.

    `feed` takes each new piece of text and returns what may be shown now (text that might
    still turn into a call is held back); `finish` returns what was held. Over a whole
    output, the contents joined are the text outside calls, and each call's argument pieces
    joined are its arguments as JSON text. Whitespace ending content before a call or at the
    end of an output with calls is dropped, as OpenAI's responses carry none.
    """

    def __init__(self) -> None:
        self.num_calls = 0
        self._blank = ""  # whitespace-only content held until text or the end decides

    @abstractmethod
    def feed(self, text: str) -> Extracted: ...

    def finish(self) -> Extracted:
        return Extracted(self._content("", final=True))

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, new_call_id(), name, arguments)

    def _content(self, text: str, final: bool = False) -> str:
        """Content to show now: trailing whitespace waits for more text, and is dropped at
        the end of an output that made calls."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        if final:
            body += "" if self.num_calls else self._blank
            self._blank = ""
        return body


class FirstCallOnly(ToolCallExtractor):
    """`parallel_tool_calls: false` where the model chooses (auto): its first call is kept,
    any later one dropped, as vLLM does; content passes unchanged."""

    def __init__(self, inner: ToolCallExtractor) -> None:
        super().__init__()
        self.inner = inner

    def feed(self, text: str) -> Extracted:
        return self._first(self.inner.feed(text))

    def finish(self) -> Extracted:
        return self._first(self.inner.finish())

    def _first(self, extracted: Extracted) -> Extracted:
        self.num_calls = min(self.inner.num_calls, 1)
        return Extracted(extracted.content, [p for p in extracted.tool_calls if p.index == 0])


class NamedCallExtractor(ToolCallExtractor):
    """The whole output is the arguments of one call to `name` (tool_choice naming a
    function); they stream as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Extracted:
        if not text:
            return Extracted()
        if self.num_calls == 0:
            return Extracted(tool_calls=[self._new_call(self.name, text)])
        return Extracted(tool_calls=[ToolCallDelta(0, arguments=text)])

    def finish(self) -> Extracted:
        if self.num_calls == 0:  # nothing generated (max_tokens): still the call asked for
            return Extracted(tool_calls=[self._new_call(self.name, "")])
        return Extracted()


class CallArrayExtractor(ToolCallExtractor):
    """The output is a JSON array of {"name", "arguments"} objects (tool_choice required);
    each call goes out whole once its object closes. Text left unparsed at the end (an
    array cut short by max_tokens) is content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.scanner = JsonScanner()
        self.consumed = 0  # text[:consumed] is accounted for (calls, or array punctuation)

    def feed(self, text: str) -> Extracted:
        out = Extracted()
        self.text += text
        for start, end in self.scanner.scan(text, depth=1):
            call = _parse_call(self.text[start:end])
            if call is None:
                continue
            out.tool_calls.append(self._new_call(*call))
            self.consumed = end
        return out

    def finish(self) -> Extracted:
        tail = self.text[self.consumed:].strip().lstrip(",").strip()
        if tail == "]" or (tail == "" and self.num_calls):
            tail = ""
        return Extracted(self._content(tail, final=True))


class TaggedCallExtractor(ToolCallExtractor):
    """Calls written as `<tool_call>JSON</tool_call>`; the JSON is one call object or a list
    of them (SmolLM2 writes lists). Text outside the tags is content; a tag's text that does
    not parse is content too, tags and all. A call the model ends without its closing tag
    still counts when its JSON parses."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> Extracted:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> Extracted:
        return self._drain(final=True) + super().finish()

    def _drain(self, final: bool) -> Extracted:
        out = Extracted()
        while True:
            if not self.inside:
                i = self.buffer.find(self.START)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, self.START)
                    out.content += self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.content += self._content(self.buffer[:i])
                self.buffer = self.buffer[i + len(self.START):]
                self.inside = True
            j = self.buffer.find(self.END)
            if j < 0 and not final:
                return out
            body = self.buffer if j < 0 else self.buffer[:j]
            self.buffer = "" if j < 0 else self.buffer[j + len(self.END):]
            self.inside = False
            calls = _parse_calls(body)
            if calls is None:
                out.content += self._content(self.START + body + (self.END if j >= 0 else ""))
            else:
                out.tool_calls += [self._new_call(*call) for call in calls]


class BareJsonCallExtractor(ToolCallExtractor):
    """Llama 3's JSON tool calling: an output that is one or more `{"name": ...,
    "parameters": {...}}` objects (separated by ";"), perhaps after `<|python_tag|>`, is
    calls; any other output is content. Held until the output's first character decides,
    and a JSON output until the end."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.mode: str | None = None  # "text" or "json" once decided

    def feed(self, text: str) -> Extracted:
        if self.mode == "text":
            return Extracted(text)
        self.buffer += text
        head = self.buffer.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return Extracted()
        self.mode = "json" if head.startswith(("{", "[", self.TAG)) else "text"
        if self.mode == "text":
            text, self.buffer = self.buffer, ""
            return Extracted(text)
        return Extracted()

    def finish(self) -> Extracted:
        text, self.buffer = self.buffer, ""
        calls = _parse_call_sequence(text.strip().removeprefix(self.TAG))
        if calls is None:
            return Extracted(text)
        return Extracted(tool_calls=[self._new_call(*call) for call in calls])


class JsonScanner:
    """Finds, in JSON text fed piece by piece, the spans of values nested at a given depth
    (depth 1: the elements of a top-level array or the values of a top-level object).
    Only objects and arrays are reported; strings and escapes are tracked so brackets
    inside them do not count."""

    def __init__(self) -> None:
        self.offset = 0  # characters seen so far
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.start = -1

    def scan(self, text: str, depth: int) -> list[tuple[int, int]]:
        """(start, end) offsets, over all text fed so far, of the values completed here."""
        spans = []
        for i, ch in enumerate(text, self.offset):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                if self.depth == depth:
                    self.start = i
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == depth and self.start >= 0:
                    spans.append((self.start, i + 1))
                    self.start = -1
        self.offset += len(text)
        return spans


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (it may be its start)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _parse_calls(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of a call object or a list of them; None if it is not that."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _parse_call(text: str) -> tuple[str, str] | None:
    try:
        return _call_of(json.loads(text))
    except ValueError:
        return None


def _parse_call_sequence(text: str) -> list[tuple[str, str]] | None:
    """Calls written one after another, separated by ";" or whitespace, or as one list."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        parsed = _parse_calls(json.dumps(value))
        if parsed is None:
            return None
        calls += parsed
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    return calls or None


def _call_of(item: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call object: "arguments" or Llama's "parameters", an
    object or its JSON text."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)
