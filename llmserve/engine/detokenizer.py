"""Incremental detokenization and stop-string matching for one sequence.

Byte-level tokens may split one character over several tokens; the decoder holds text back
while the newest tokens decode to an incomplete character (U+FFFD) and emits it once whole.
Decoding a window that starts a few tokens back keeps tokenizers that strip a leading space
of the first token (SentencePiece) from losing spaces.
"""

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def append(self, token_id: int) -> str | None:
        """Add a token; return the stop string if the text now contains one (text is cut)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # incomplete character: wait for more bytes
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def flush(self) -> None:
        """At the end, emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that may begin a stop string."""
        if finished or self.max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]

    def _check_stop(self, delta_len: int) -> str | None:
        if not self.stop:
            return None
        start = max(0, len(self.text) - delta_len - self.max_stop_len + 1)
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, start)) != -1]
        if not found:
            return None
        at, stop = min(found)  # the earliest match wins
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        return stop

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
