"""Tokenizer and chat template against transformers on the real default model (SmolLM2).

Known difference: transformers' GGUF converter gives SmolLM2 a plain GPT-2 ByteLevel
pre-tokenizer, but the real SmolLM2 tokenizer.json (and llama.cpp's `smollm` pre-tokenizer)
first splits every digit off (`Digits(individual_digits=True)`). SmolLM2's vocab has no
token mixing digits with anything else, so ids differ only where whitespace precedes a digit:
"x  1" is real [x, ĠĠ, 1] but converter [x, Ġ, Ġ, 1]. We follow the real tokenizer, so:
texts without digits are compared with the transformers reference as is; every text is
compared with that reference given the real pre-tokenizer back; digit cases are hand-checked.
"""

import json
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from llmserve.errors import UnsupportedModelError
from llmserve.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it; he'd LOVE IT'S",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 😀🚀👨‍👩‍👧 and flags 🇫🇷",
    "café naïve façade Ångström résumé",
    "combining: e\u0301 a\u0308 n\u0303 (decomposed)",
    "   leading spaces and trailing   ",
    "tabs\tand\t\tmore\ttabs",
    "lines\nand\n\nblank\r\nlines\n",
    "  \n \t \n",
    'def f(x):\n    return {"a": x ** two}\n\nclass A:\n    pass\n',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> in the middle",
    "",
]
DIGIT_TEXTS = [
    "Hello 12345 world",
    "x  1",
    "a\n\n1",
    "year 2024, pi = 3.14159",
    "items = [\n    1,\n    22,\n]",
    "\t\t7 ½ ²",
]
SMOLLM2_CHAT = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語?"},
    ],
]


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def reference(smollm2_gguf: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def real_reference(reference):
    """The transformers reference with SmolLM2's real pre-tokenizer (digits split first)."""
    backend = reference.backend_tokenizer.__class__.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(tokenizer: Tokenizer, reference, text: str) -> None:
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_encode_matches_real_pre_tokenizer(tokenizer: Tokenizer, real_reference, text: str) -> None:
    assert tokenizer.encode(text) == real_reference.encode(text).ids


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_decode_round_trips(tokenizer: Tokenizer, reference, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize(
    ("text", "tokens", "ids"),
    [
        # Digits are single tokens; whitespace before a digit stays one run, as in the real
        # SmolLM2 tokenizer and llama.cpp (the transformers GGUF converter splits "ĠĠ").
        ("x  1", ["x", "ĠĠ", "1"], [104, 256, 33]),
        ("a\n\n1", ["a", "ĊĊ", "1"], [81, 1116, 33]),
        (
            "Hello 12345 world",
            ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld"],
            [19556, 216, 33, 34, 35, 36, 37, 905],
        ),
        ("x = [\n    1,", ["x", "Ġ=", "Ġ[", "ĊĠĠĠĠ", "1", ","], [104, 446, 933, 2367, 33, 28]),
        # Any \p{N} character is split off, not only ASCII digits.
        ("\t\t7 ½", ["ĉĉ", "7", "Ġ", "Â½"], [1656, 39, 216, 16738]),
    ],
)
def test_digits_split_like_real_tokenizer(
    tokenizer: Tokenizer, text: str, tokens: list[str], ids: list[int]
) -> None:
    assert tokenizer.encode(text) == ids
    assert [tokenizer.id_to_token(i) for i in ids] == tokens


def test_special_ids(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.eos_token_id == reference.eos_token_id == 2
    assert tokenizer.vocab_size == len(reference) == 49152
    assert tokenizer.all_special_ids == list(range(17))  # the GGUF control tokens
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.encode("<|im_start|>") == [1]


def test_stop_token_ids(tokenizer: Tokenizer) -> None:
    # eos (<|im_end|>, the ChatML turn terminator) and <|endoftext|>.
    assert tokenizer.stop_token_ids == frozenset({0, 2})


@pytest.mark.parametrize("messages", SMOLLM2_CHAT)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(
    tokenizer: Tokenizer, reference, messages: list[dict], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == expected
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == reference.encode(expected, add_special_tokens=False)


def test_chat_template_helpers() -> None:
    template = (
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0] | tojson }}{{ strftime_now('%Y') | length }}"
        "{% generation %}{{ extra }}{% endgeneration %}"
    )
    tok = _toy_tokenizer(template)
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}], extra="!")
    assert out == '<s>{"role": "user", "content": "é<b>"}4!'
    with pytest.raises(ChatTemplateError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_no_chat_template_is_an_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _toy_tokenizer(None).apply_chat_template([{"role": "user", "content": "hi"}])


# Templates come from model files: a hostile one tries to reach Python's internals (to read
# files or run commands) through the objects it is given, or to exhaust the server.
HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {canary}') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch {canary}').read() }}",
    "{{ lipsum.__globals__['os'].system('touch {canary}') }}",
    "{{ self.__init__.__globals__.__builtins__.open('{canary}', 'w') }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('{canary}', 'w') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "{{ messages.append(1) }}{{ messages.pop() }}",
    "{% include '{canary}' %}",
    "{% for i in range(10 ** 10) %}{{ i }}{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_a_hostile_template_fails_safely(template: str, tmp_path: Path) -> None:
    """The sandbox refuses: a ChatTemplateError (a 400 for the request), no file written,
    no command run, the messages unchanged."""
    canary = tmp_path / "canary"
    tok = _toy_tokenizer(template.replace("{canary}", str(canary)))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="chat template error"):
        tok.apply_chat_template(messages)
    assert not canary.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_variables_from_the_caller() -> None:
    """Extra variables win over the special-token strings (as in transformers); one that
    makes the prompt invalid Unicode is refused, not handed to the Rust tokenizer."""
    tok = _toy_tokenizer("{{ bos_token }}{{ extra }}")
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, bos_token="[B]", extra="!") == "[B]!"
    with pytest.raises(ChatTemplateError, match="not valid Unicode"):
        tok.apply_chat_template(messages, extra="\ud800", tokenize=True)


def test_unsupported_gguf_tokenizers() -> None:
    with pytest.raises(UnsupportedModelError, match="'rwkv'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(UnsupportedModelError, match="'nonesuch'"):
        Tokenizer.from_gguf_metadata(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonesuch"}
        )


def test_sentencepiece_vocabulary_from_gguf_metadata() -> None:
    """A Llama-2-style SentencePiece vocabulary: merges recovered from the scores, a space
    put before the text, bytes outside the vocabulary spelled with byte tokens, BOS added
    (llama.cpp's default for these vocabularies). The real one (Gemma 3) is compared
    with transformers in tests/models/test_gemma3_reference.py."""
    tokens = ["<unk>", "<s>", "</s>", "<0x63>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, -5.0, -1.0, -2.0, -3.0, -4.0, -1.5],
        "tokenizer.ggml.token_type": [2, 3, 3, 6, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("ab") == [1, 9]  # <s> ▁ab
    assert tok.encode("ab ab c", add_special_tokens=False) == [9, 9, 4, 3]
    assert tok.decode([1, 9, 9, 4, 3], skip_special_tokens=True) == "ab ab c"
    assert tok.stop_token_ids == frozenset({2})


def test_add_bos_eos_from_metadata() -> None:
    tokens = ["<s>", "</s>", "a", "b", "ab"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("abab") == [0, 4, 4, 1]
    assert tok.encode("abab", add_special_tokens=False) == [4, 4]
    assert tok.decode([0, 4, 1], skip_special_tokens=True) == "ab"


def test_hf_folder_round_trip(tokenizer: Tokenizer, reference, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == reference.encode(text)
    assert folder.bos_token_id == 1 and folder.eos_token_id == 2
    assert folder.chat_template == tokenizer.chat_template
    assert folder.stop_token_ids == frozenset({0, 2, 7})
    messages = SMOLLM2_CHAT[1]
    assert folder.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def _toy_tokenizer(chat_template: str | None) -> Tokenizer:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a"],
        "tokenizer.ggml.token_type": [3, 3, 1],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("text", [
    "The library holds books about rivers and mountains. " * 3000,
    "word" * 40_000,  # no space to cut before: pieces of whole characters
    ("数字 123456 and émigré " * 5000),
])
def test_encode_head_is_the_whole_encodings_beginning(tokenizer: Tokenizer, text: str) -> None:
    """The first tokens of a long text, tokenizing only its head, are those of the whole."""
    whole = tokenizer.encode(text)
    for limit in (1, 511, 4096):
        assert tokenizer.encode_head(text, limit) == whole[:limit]
    short = "A short text."
    assert tokenizer.encode_head(short, 100) == tokenizer.encode(short)
