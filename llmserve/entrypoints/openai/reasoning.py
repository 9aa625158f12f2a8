"""Reasoning parsers (`--reasoning-parser`): the thinking a model writes between `<think>`
and `</think>` goes to `reasoning_content`, the rest to `content`, whole and streamed.

* `deepseek_r1`: the answer opens in reasoning (its template writes `<think>` into the
  prompt, or the model writes it first); without `</think>` everything is reasoning (cut by
  max_tokens).
* `qwen3`: reasoning only when the output opens with `<think>` or the prompt ends with it
  (templates that start the thinking); `enable_thinking: false` in `chat_template_kwargs`
  makes the template close the block in the prompt, and the whole output is content.

`auto` (the server's default) picks one from the model's chat template, as llama.cpp's
`--reasoning-format auto` does: a template that writes `<think>` and knows the
`enable_thinking` switch is qwen3's family, one that writes `<think>` without it
deepseek_r1's; a template without `<think>` gets no parser (all output is content).

Where the answer opens in reasoning, a constraint (JSON schema, regex, the tool grammar)
starts after `</think>` (`StructuredOutputsParams.starts_after`), and tool calls are read
from the content only.
"""

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
CHOICES = ("auto", "none", *PARSERS)  # --reasoning-parser


def resolve_parser(choice: str | None, chat_template: str | None) -> str | None:
    """The parser a server runs for `--reasoning-parser choice` (None: none)."""
    if choice is None or choice == "none":
        return None
    if choice != "auto":
        return choice
    return template_parser(chat_template)


def template_parser(chat_template: str | None) -> str | None:
    """The reasoning family a chat template declares (see the module's docstring)."""
    if not chat_template or (START not in chat_template and END not in chat_template):
        return None
    return "qwen3" if "enable_thinking" in chat_template else "deepseek_r1"


@dataclass
class ReasoningStart:
    """How an answer opens: in reasoning (`thinking`), or not yet known (`maybe`: qwen3,
    whose output may open with <think>)."""

    thinking: bool
    maybe: bool


def answer_start(parser: str, prompt_text: str) -> ReasoningStart:
    """Where the answer to `prompt_text` (the rendered chat) opens."""
    tail = prompt_text.rstrip()
    if tail.endswith(END):  # the template closed the block: no thinking (enable_thinking off)
        return ReasoningStart(False, False)
    if parser == "deepseek_r1" or tail.endswith(START):
        return ReasoningStart(True, False)
    return ReasoningStart(False, True)


def split_reasoning(text: str, start: ReasoningStart) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None when there was none."""
    stream = ReasoningStream(start)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if stream.saw_reasoning else None), content


class ReasoningStream:
    """Splits an answer fed in pieces: `feed` returns the (reasoning, content) text that can
    be shown now, holding back what may be the start of a tag; `finish` the rest."""

    def __init__(self, start: ReasoningStart) -> None:
        self.mode = "reasoning" if start.thinking else ("maybe" if start.maybe else "content")
        self.saw_reasoning = start.thinking
        self.at_start = True  # a reasoning answer may repeat the opening <think>: dropped
        self.after_end = False  # the newlines after </think> are dropped
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = "", ""
        while True:
            if self.mode == "maybe":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held = stripped[len(START):]
                    self.mode, self.saw_reasoning, self.at_start = "reasoning", True, False
                    continue
                if START.startswith(stripped):  # still possibly the opening tag
                    return reasoning, content
                self.mode = "content"
            if self.mode == "content":
                if self.after_end:
                    self.held = self.held.lstrip("\n")
                    self.after_end = not self.held
                content += self.held
                self.held = ""
                return reasoning, content
            # reasoning: until </think>
            if self.at_start:
                stripped = self.held.lstrip()
                if START.startswith(stripped) and stripped != START:
                    return reasoning, content  # maybe the opening tag, repeated
                if stripped.startswith(START):
                    self.held = stripped[len(START):]
                self.at_start = False
            end = self.held.find(END)
            if end >= 0:
                reasoning += self.held[:end]
                self.held = self.held[end + len(END):]
                self.mode, self.after_end = "content", True
                continue
            keep = _partial_suffix(self.held, END)
            reasoning += self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.mode == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
