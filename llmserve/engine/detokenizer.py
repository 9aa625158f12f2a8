"""Incremental detokenization and stop-string matching for one sequence.

Byte-level tokens may split one character over several tokens; the decoder holds text back
while the newest tokens decode to an incomplete character (U+FFFD) and emits it once whole.
Decoding a window that starts a few tokens back keeps tokenizers that strip a leading space
of the first token (SentencePiece) from losing spaces.

Per token the work is O(1) amortized: two decodes of a short window of ids
(`ids[prefix_offset:]`), a stop-string search over the new text plus the last
`max_stop_len - 1` characters, and an append to a list of text pieces (joined only when the
whole text is asked for). `next_text()` hands out the visible text not handed out before:

    text:  | handed out | visible, new | held back (may begin a stop string) |
           0          _sent          visible_end                          len(text)
"""

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5
# A valid character completes within 4 bytes; if the newest tokens still end in an
# incomplete character after this many, they are garbage: emit them (as U+FFFD) rather
# than let the decode window, and so the per-token cost, grow without bound.
_MAX_PENDING_TOKENS = 16


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
        detokenize: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize  # False: token ids only, the text stays empty
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._parts: list[str] = []  # the text, in pieces; `text` joins them
        self._len = 0  # len(text)
        self._tail = ""  # the last max_stop_len - 1 characters: where a stop may begin
        self._sent = 0  # characters already handed out by next_text()

    @property
    def text(self) -> str:
        """The whole text so far (O(len) when it grew since the last call)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def append(self, token_id: int) -> str | None:
        """Add a token; return the stop string if the text now contains one (text is cut)."""
        if not self.detokenize:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        pending = len(self.ids) - self.read_offset
        if len(full) <= len(prefix) or (
            full.endswith("\ufffd") and pending < _MAX_PENDING_TOKENS
        ):
            return None  # incomplete character: wait for more bytes
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._add(full[len(prefix) :])

    def flush(self) -> None:
        """At the end, emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self._parts.append(full[len(prefix) :])
            self._len += len(self._parts[-1])
            self.read_offset = len(self.ids)

    def visible_text(self, finished: bool) -> str:
        """All text safe to show (O(len)): while running, minus a possible stop-string start."""
        return self.text[: self._visible_end(finished)]

    def next_text(self, finished: bool) -> str:
        """The visible text not returned by an earlier call (cost ~ the text not yet returned)."""
        end = self._visible_end(finished)
        if end <= self._sent:
            return ""
        new = self._suffix(self._sent)[: end - self._sent]
        self._sent = end
        return new

    def _visible_end(self, finished: bool) -> int:
        if finished or self.max_stop_len <= 1:
            return self._len
        # never below what was handed out: a stop string is only searched for in text that
        # was held back, so a match never takes back text already shown
        return max(self._sent, self._len - self.max_stop_len + 1)

    def _add(self, delta: str) -> str | None:
        self._parts.append(delta)
        self._len += len(delta)
        if not self.stop:
            return None
        window = self._tail + delta  # every stop string ending in `delta` starts in here
        window_start = self._len - len(window)
        found = [(at, stop) for stop in self.stop if (at := window.find(stop)) != -1]
        if not found:
            keep = self.max_stop_len - 1
            self._tail = window[-keep:] if keep else ""
            return None
        at, stop = min(found)  # the earliest match wins
        end = window_start + at + (len(stop) if self.include_stop else 0)
        self._parts[:] = [self.text[:end]]
        self._len = end
        return stop

    def _suffix(self, start: int) -> str:
        """text[start:], joining only the last pieces."""
        need, pieces, size = self._len - start, [], 0
        for part in reversed(self._parts):
            if size >= need:
                break
            pieces.append(part)
            size += len(part)
        joined = "".join(reversed(pieces))
        return joined[len(joined) - need :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
