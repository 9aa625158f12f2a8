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
