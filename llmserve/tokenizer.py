"""Text <-> token ids and chat templates, for GGUF files and Hugging Face folders.

The heavy lifting is the `tokenizers` library (Rust BPE); this module only builds the right
pipeline from a GGUF file's metadata, so that ids match what the model was trained on
(llama.cpp's pre-tokenizer for each `tokenizer.ggml.pre`), and renders the model's chat
template in a sandboxed jinja2 environment the way `transformers` does.
"""

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llmserve.errors import (
    LLMServeError,
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from llmserve.loader.gguf_meta import open_gguf, read_metadata


class ChatTemplateError(LLMServeError):
    """The chat template cannot render these messages (or the model has no template)."""


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

# Tokens that end a chat turn, counted as stop tokens when the chat template uses them.
_TURN_TERMINATORS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# End-of-document tokens: a model that emits one is done, whatever its metadata's eos says.
_DOCUMENT_TERMINATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
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


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _compile_chat_template(source: str) -> jinja2.Template:
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


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, stop tokens and chat template.

    Build it with `from_gguf`, `from_gguf_metadata` or `from_hf_folder`. The wrapped
    `tokenizers.Tokenizer` adds BOS/EOS itself (its post-processor), so `encode` with
    `add_special_tokens=True` gives exactly what the model expects as a prompt.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._extra_eos_token_ids = frozenset(extra_eos_token_ids)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer embedded in a GGUF model file."""
        return cls.from_gguf_metadata(read_metadata(open_gguf(path)))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF `tokenizer.*` metadata (as `read_metadata` returns it): byte-level
        BPE (`tokenizer.ggml.model == "gpt2"`) or a SentencePiece BPE vocabulary (`llama`,
        e.g. Gemma's, Llama 2's). Other kinds raise `UnsupportedModelError`."""
        kind = meta.get("tokenizer.ggml.model")
        _check_gguf_tokenizer_metadata(meta)
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
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            # as llama.cpp, an optional special id outside the vocabulary is ignored
            unk_token_id=_token_id_or_none(meta, "tokenizer.ggml.unknown_token_id"),
            pad_token_id=_token_id_or_none(meta, "tokenizer.ggml.padding_token_id"),
            chat_template=template,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """A Hugging Face model folder: tokenizer.json, tokenizer_config.json, and optionally
        chat_template.jinja (wins over the config's template) and generation_config.json
        (its eos ids become stop tokens). BOS/EOS are added by tokenizer.json's own
        post-processor, which is where transformers writes them when saving."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {folder}")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelFormatError(f"cannot read {tokenizer_file}: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
            chat_template=_hf_chat_template(folder, config),
            extra_eos_token_ids=_as_id_list(generation.get("eos_token_id")),
        )

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become
        their ids, as in transformers and llama.cpp's server."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id` (byte-level form, e.g. 'Ġhello')."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocab may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of all special (control) tokens: those `skip_special_tokens` drops."""
        decoder = self.backend.get_added_tokens_decoder()
        return sorted(i for i, tok in decoder.items() if tok.special)

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: eos, generation_config eos ids, the chat turn terminator
        the template writes (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...) and
        end-of-document tokens (`<|endoftext|>`, ...) that are special tokens of this model.

        Metadata eos alone is not enough: chat models end turns with a terminator that is
        often not the configured eos, and users expect generation to stop there.
        """
        ids = set(self._extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        template = self.chat_template or ""
        terminators = [t for t in _TURN_TERMINATORS if t in template]
        special = set(self.all_special_ids)
        for token in (*terminators, *_DOCUMENT_TERMINATORS):
            token_id = self.backend.token_to_id(token)
            if token_id is not None and token_id in special:
                ids.add(token_id)
        return frozenset(ids)

    # ---- chat template ------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        return _compile_chat_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers does.

        A model without a template is an error (`ChatTemplateError`), not a silent ChatML
        default: a wrong prompt format degrades answers without any visible failure.
        Extra `kwargs` are template variables. With `tokenize=True` the prompt's ids are
        returned, with no BOS/EOS added (the template writes the special tokens it wants).
        """
        try:
            prompt = self._compiled_template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **{**self._special_token_strings(), **kwargs},  # as transformers: kwargs win
            )
        except jinja2.TemplateError as e:  # raise_exception(), the sandbox's refusals
            raise ChatTemplateError(f"chat template error: {e}") from None
        except Exception as e:  # the template is untrusted code: any failure is this request's
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
        if not prompt.isascii() and _has_lone_surrogate(prompt):
            raise ChatTemplateError("the rendered prompt is not valid Unicode (a lone "
                                    "surrogate, e.g. from chat_template_kwargs or tools)")
        if tokenize:
            return self.encode(prompt, add_special_tokens=False)
        return prompt

    def _special_token_strings(self) -> dict[str, str]:
        """bos_token/eos_token/... as strings, the variables templates refer to."""
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        strings = {name: self.id_to_token(i) for name, i in named.items() if i is not None}
        return {name: s for name, s in strings.items() if s is not None}


def _check_gguf_tokenizer_metadata(meta: dict[str, Any]) -> None:
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


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"cannot parse {path}: {e}") from None


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja if present, else tokenizer_config's (string, or the 'default'
    entry of a list of named templates)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_id_list(value: Any) -> list[int]:
    """generation_config's eos_token_id is an int or a list of ints."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
