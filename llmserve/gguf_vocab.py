"""`tokenizers` pipelines from a GGUF file's `tokenizer.*` metadata: byte-level BPE with
llama.cpp's pre-tokenizer for each `tokenizer.ggml.pre`, and SentencePiece BPE vocabularies
(merges recovered from the vocabulary), so that ids match what the model was trained on.
The metadata comes from an untrusted file: it is checked before anything is built."""

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llmserve.errors import ModelFormatError, UnsupportedModelError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns, as in the models' own tokenizer.json files (the `tokenizers`
# library runs Oniguruma, so the original `(?i:...)` forms work; llama.cpp spells them out).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    """How one family of `tokenizer.ggml.pre` values splits text before BPE."""

    pattern: str | None  # None: the GPT-2 pattern built into ByteLevel
    individual_digits: bool = False  # split every \p{N} character off first
    ignore_merges: bool = False  # a whole pre-token found in the vocab is one token

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps: list[pre_tokenizers.PreTokenizer] = []
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if self.pattern is not None:
            steps.append(pre_tokenizers.Split(Regex(self.pattern), behavior="isolated"))
        steps.append(
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.pattern is None)
        )
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


_GPT2 = _PreTokenizerSpec(pattern=None)
_DIGITS_GPT2 = _PreTokenizerSpec(pattern=None, individual_digits=True)
_LLAMA3 = _PreTokenizerSpec(pattern=_LLAMA3_PATTERN, ignore_merges=True)
_QWEN2 = _PreTokenizerSpec(pattern=_QWEN2_PATTERN)

# `tokenizer.ggml.pre` -> pre-tokenizer, grouped as llama.cpp's llm_tokenizer_bpe groups them.
_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), _GPT2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _DIGITS_GPT2
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "stablelm2"), _QWEN2),
}

_SPIECE_SPACE = "\u2581"  # SentencePiece's visible space
# Recovering a SentencePiece vocabulary's merges costs the square of a token's length; real
# tokens are tens of characters, a longer one is a corrupt (or hostile) file.
_MAX_SENTENCEPIECE_TOKEN_CHARS = 1024

# Chat templates for GGUF files that carry none (base models), by `general.architecture`;
# a file's own `tokenizer.chat_template` always wins.
DEFAULT_CHAT_TEMPLATES = {
    # Gemma's turn format: the system prompt opens the first user turn
    "gemma3": (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
        "{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') "
        "+ message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}


def gguf_backend(meta: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """The `tokenizers` pipeline of GGUF metadata (BOS/EOS added as the file asks), and the
    tokenizer's special ids and chat template: bos/eos/unk/pad_token_id, chat_template
    (the file's own, else its family's for files that carry none)."""
    kind = meta.get("tokenizer.ggml.model")
    check_gguf_tokenizer_metadata(meta)
    tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_backend(meta, tokens, token_types)
    elif kind == "llama":
        backend = _sentencepiece_backend(meta, tokens, token_types)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: byte-level BPE "
            "'gpt2', SentencePiece 'llama'); use the model's Hugging Face folder instead"
        )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    post = _bos_eos_processor(tokens, bos if add_bos and bos is not None else None,
                              eos if add_eos else None)
    if post is not None:
        backend.post_processor = post
    template = meta.get("tokenizer.chat_template")
    if template is None:
        template = DEFAULT_CHAT_TEMPLATES.get(_gguf_architecture(meta))
    return backend, {
        "bos_token_id": bos,
        "eos_token_id": eos,
        # as llama.cpp, an optional special id outside the vocabulary is ignored
        "unk_token_id": _token_id_or_none(meta, "tokenizer.ggml.unknown_token_id"),
        "pad_token_id": _token_id_or_none(meta, "tokenizer.ggml.padding_token_id"),
        "chat_template": template,
    }


def check_gguf_tokenizer_metadata(meta: dict[str, Any]) -> None:
    """The `tokenizer.*` metadata of an untrusted file has the types and lengths the
    builders rely on: a ModelFormatError naming the key, not a crash in `tokenizers`."""

    def bad(key: str, problem: str) -> ModelFormatError:
        return ModelFormatError(f"GGUF tokenizer metadata: {key} {problem}")

    tokens = meta.get("tokenizer.ggml.tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise bad("tokenizer.ggml.tokens", "must be a list of strings")
    per_token = {"tokenizer.ggml.token_type": (int,), "tokenizer.ggml.scores": (int, float)}
    for key, types in per_token.items():
        values = meta.get(key, [0] * len(tokens))
        if not isinstance(values, list) or not all(type(v) in types for v in values):
            raise bad(key, f"must be a list of {' or '.join(t.__name__ for t in types)}s")
        if len(values) != len(tokens):
            raise bad(key, f"has {len(values)} entries for {len(tokens)} tokens")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise bad("tokenizer.ggml.merges", "must be a list of 'left right' strings")
    for key in ("bos", "eos", "unknown", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and type(value) is not int:
            raise bad(f"tokenizer.ggml.{key}_token_id", f"must be a token id, got {value!r}")
        if key in ("bos", "eos") and value is not None and not 0 <= value < len(tokens):
            raise bad(f"tokenizer.ggml.{key}_token_id",
                      f"is {value}, outside the {len(tokens)} tokens")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if not isinstance(meta.get(key, ""), str):
            raise bad(key, f"must be a string, got {meta[key]!r}")
    if meta.get("tokenizer.ggml.model") == "llama":
        longest = max(tokens, key=len, default="")
        if len(longest) > _MAX_SENTENCEPIECE_TOKEN_CHARS:
            raise bad("tokenizer.ggml.tokens", f"holds a token of {len(longest)} characters "
                      f"(at most {_MAX_SENTENCEPIECE_TOKEN_CHARS})")


def _token_id_or_none(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    num_tokens = len(meta.get("tokenizer.ggml.tokens", []))
    return value if value is not None and 0 <= value < num_tokens else None


def _gguf_architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture", "")
    return arch if isinstance(arch, str) else ""


def _gguf_added_tokens(tokens: list[str], token_types: list[int], kind: int) -> list[AddedToken]:
    """Tokens of one GGUF type, matched verbatim in text before pre-tokenization."""
    special = kind == _TOKEN_TYPE_CONTROL
    return [
        AddedToken(tok, special=special, normalized=False)
        for tok, tt in zip(tokens, token_types, strict=True)
        if tt == kind
    ]


def _byte_level_backend(meta: dict[str, Any], tokens: list[str],
                        token_types: list[int]) -> HFTokenizer:
    """Byte-level BPE with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=spec.ignore_merges)  # type: ignore[arg-type]
    except Exception as e:  # tokenizers raises a bare Exception on a merge it cannot use
        raise ModelFormatError(f"GGUF tokenizer metadata: tokenizer.ggml.merges: "
                               f"{str(e)[:200]!r}") from None
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = spec.build()
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(_gguf_added_tokens(tokens, token_types, _TOKEN_TYPE_USER_DEFINED))
    backend.add_special_tokens(_gguf_added_tokens(tokens, token_types, _TOKEN_TYPE_CONTROL))
    return backend


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str],
                           token_types: list[int]) -> HFTokenizer:
    """A SentencePiece BPE vocabulary as a `tokenizers` BPE with byte fallback.

    Spaces are written as U+2581 (and, with `add_space_prefix`, one is put before the
    text). GGUF files keep no merges for these vocabularies, so they are recovered from the
    vocabulary (`_sentencepiece_merges`). Gemma files spell their whitespace-run tokens
    with real spaces ("  "); those are respelled with U+2581, the form the merges reach.
    """
    gemma = _gguf_architecture(meta).startswith("gemma")
    if gemma:
        tokens = [_SPIECE_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if gemma:  # Gemma's merge order is the vocabulary's order, not its scores
        priority: list[float] = [-i for i in range(len(tokens))]
    else:
        priority = list(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = HFTokenizer(models.BPE(
        vocab, _sentencepiece_merges(tokens, priority),  # type: ignore[arg-type]
        unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPIECE_SPACE)]
    if space_prefix:
        steps.insert(0, normalizers.Prepend(_SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps: list[decoders.Decoder] = [
        decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    # user-defined tokens ("\n", "<start_of_image>") stay whole, unless respelled above
    user = [t for t in _gguf_added_tokens(tokens, token_types, _TOKEN_TYPE_USER_DEFINED)
            if not t.content.startswith(_SPIECE_SPACE)]
    backend.add_tokens(user)
    backend.add_special_tokens(_gguf_added_tokens(tokens, token_types, _TOKEN_TYPE_CONTROL))
    return backend


def _sentencepiece_merges(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every way of cutting a token into
    two vocabulary pieces, best token first (highest `priority`), and for one token the
    longer left piece first (as SentencePiece's own BPE and transformers order them)."""
    vocab = set(tokens)
    found: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-priority[index], index, len(token) - cut, left, right))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for _, _, _, left, right in found]


def _bos_eos_processor(
    tokens: list[str], bos: int | None, eos: int | None
) -> processors.PostProcessor | None:
    """A post-processor adding BOS and/or EOS around every encoded text, or None."""
    if bos is None and eos is None:
        return None
    ends = {i: tokens[i] for i in (bos, eos) if i is not None}

    def wrap(sequence: str, type_id: int) -> str:
        parts = [f"{tokens[bos]}:{type_id}"] if bos is not None else []
        parts.append(f"{sequence}:{type_id}")
        parts += [f"{tokens[eos]}:{type_id}"] if eos is not None else []
        return " ".join(parts)

    return processors.TemplateProcessing(
        single=wrap("$A", 0),
        pair=f"{wrap('$A', 0)} {wrap('$B', 1)}",
        special_tokens=[(tok, i) for i, tok in ends.items()],
    )
