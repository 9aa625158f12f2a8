"""Incremental detokenization and stop strings, on the real tokenizer (no model)."""

import pytest

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


TEXTS = [
    "Hello, world! How are you today?",
    "Ünïcödé — naïve café, 東京タワー, 😀🎉 and 👩‍👩‍👧",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "def f(x):\n    return x ** 2  # 12345",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    seen = []
    for token in ids:
        assert detok.append(token) is None
        seen.append(detok.text)
        assert "\ufffd" not in detok.text  # never shows half a character
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))  # append-only


def test_multibyte_character_split_over_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level: one emoji, several tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids[:-1]:
        detok.append(token)
        assert detok.text == ""
    detok.append(ids[-1])
    assert detok.text == "😀"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids[:-1]:
        detok.append(token)
    assert detok.text == "a"
    detok.flush()
    assert detok.text.startswith("a") and detok.text.endswith("\ufffd")


def _feed(tokenizer, text, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, [], **kwargs)
    for token in tokenizer.encode(text, add_special_tokens=False):
        stop = detok.append(token)
        if stop is not None:
            return detok, stop
    return detok, None


def test_stop_string_cuts_text_and_is_not_returned(tokenizer):
    detok, stop = _feed(tokenizer, "One. Two. STOP here. Three.", stop=["STOP"])
    assert stop == "STOP"
    assert detok.text == "One. Two. "


def test_stop_string_included_on_request(tokenizer):
    detok, stop = _feed(tokenizer, "One. Two. STOP here.", stop=["STOP"],
                        include_stop_str_in_output=True)
    assert detok.text == "One. Two. STOP"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok, stop = _feed(tokenizer, "alpha beta gamma", stop=["gamma", "beta"])
    assert stop == "beta"
    assert detok.text == "alpha "


def test_stop_string_spanning_tokens(tokenizer):
    detok, stop = _feed(tokenizer, "the end of the story", stop=["end of"])
    assert stop == "end of"
    assert detok.text == "the "


def test_visible_text_holds_back_possible_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["###"])
    for token in tokenizer.encode("Answer: 42 #", add_special_tokens=False):
        detok.append(token)
    assert detok.text.endswith("#")
    assert detok.visible_text(finished=False) == detok.text[:-2]
    assert detok.visible_text(finished=True) == detok.text


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|>", add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    for token in ids:
        kept.append(token)
        skipped.append(token)
    assert kept.text == "Hi<|im_end|>"
    assert skipped.text == "Hi"


def _deltas(tokenizer, text, **kwargs) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `text` token by token, taking `next_text()` after each; flush at the end."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"), **kwargs)
    deltas, stop = [], None
    for token in tokenizer.encode(text, add_special_tokens=False):
        stop = detok.append(token)
        if stop is not None:
            break
        deltas.append(detok.next_text(finished=False))
    if stop is None:
        detok.flush()
    deltas.append(detok.next_text(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize(("stop", "include"), [
    ([], False), (["STOP here"], False), (["STOP here"], True), (["##", "e. T"], False),
])
def test_next_text_pieces_add_up_to_the_text(tokenizer, stop, include):
    text = "One. Two. Three. STOP here. Four 😀 ## five"
    detok, deltas, found = _deltas(tokenizer, text, stop=stop, include_stop_str_in_output=include)
    assert "".join(deltas) == detok.text
    if stop:
        assert found is not None
        cut = text.index(found) + (len(found) if include else 0)
        assert detok.text == text[:cut]
        # held back while running: no piece but the last one shows any of the stop string
        assert all(found[:2] not in piece for piece in deltas[:-1])
    else:
        assert detok.text == text


class ByteDecoder:
    """A byte-level fake tokenizer: token id i is byte i; counts the ids it decodes."""

    def __init__(self) -> None:
        self.num_decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.num_decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def test_per_token_work_is_bounded():
    """Decoding cost per token does not grow with the text, even for bytes that never
    form a character (lone continuation bytes, as a random model may sample)."""
    decoder = ByteDecoder()
    detok = IncrementalDetokenizer(decoder, [], stop=["xyz"])
    num_tokens = 4000
    for i in range(num_tokens):
        detok.append(0x80 if i % 2000 < 1000 else ord("a"))  # long runs of invalid bytes
        detok.next_text(finished=False)
    # a bounded window decodes ~2 x (context + pending) ids a token (~86k here); a window
    # growing over each invalid run would decode ~1M, the whole text every time ~16M
    assert decoder.num_decoded < 40 * num_tokens
    detok.flush()
    assert len(detok.text) == num_tokens  # each invalid byte shows as one U+FFFD


def test_character_split_over_byte_tokens_waits_for_its_last_byte():
    detok = IncrementalDetokenizer(ByteDecoder(), [])
    pieces = []
    for byte in "a😀b".encode():
        detok.append(byte)
        pieces.append(detok.next_text(finished=False))
    assert pieces == ["a", "", "", "", "😀", "b"]
