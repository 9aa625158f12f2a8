"""Text <-> token ids and chat templates, for GGUF files and Hugging Face folders.

The heavy lifting is the `tokenizers` library (Rust BPE); a GGUF file's pipeline is built
from its metadata (`gguf_vocab.py`), and the model's chat template is rendered in a
sandboxed jinja2 environment the way `transformers` does (`chat_template.py`).
"""

import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from llmserve.chat_template import ChatTemplateError, compile_chat_template, has_lone_surrogate
from llmserve.errors import LLMServeError, ModelFormatError, ModelNotFoundError
from llmserve.gguf_meta import open_gguf, read_metadata
from llmserve.gguf_vocab import gguf_backend

__all__ = ["ChatTemplateError", "Tokenizer"]

# Tokens that end a chat turn, counted as stop tokens when the chat template uses them.
_TURN_TERMINATORS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# End-of-document tokens: a model that emits one is done, whatever its metadata's eos says.
_DOCUMENT_TERMINATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Fill-in-the-middle tokens of code models (prefix, suffix, middle), written in that order
# before the text around the hole ("PSM"); the model writes what goes in it.
_FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3
               ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
               ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
                "<\uff5cfim\u2581end\uff5c>"))  # DeepSeek-Coder

_PIECE_CHARS = 8192  # of a long prompt, tokenized in turn while counting against a limit
_SEAM_TOKENS = 16  # tokens a cut between two pieces can add, at most (a special token cut)


class PromptTooLong(LLMServeError, ValueError):
    """A prompt with more tokens than the model's context can take (`limit`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the prompt has more than {limit} tokens; the model's context is "
                         f"{limit} tokens and at least one must be left to generate")
        self.limit = limit


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
        backend, special = gguf_backend(meta)
        return cls(backend, **special)

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

    def encode(self, text: str, add_special_tokens: bool = True,
               limit: int | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become
        their ids, as in transformers and llama.cpp's server.

        `limit`: a text with certainly more tokens than that raises `PromptTooLong` once
        about `limit` tokens of it are tokenized, not after all of it (a 4 MB prompt is a
        million tokens: 2-3 s of a core and ~350 MB, for a prompt the model cannot take)."""
        if limit is not None and self._exceeds(text, limit):
            raise PromptTooLong(limit)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_head(self, text: str, limit: int, add_special_tokens: bool = True
                    ) -> list[int]:
        """The first `limit` token ids of `text`, as encoding it whole and cutting would
        give them, tokenizing only a little more than `limit` tokens of it (the text's
        head up to the piece where its tokens pass the limit for certain)."""
        end = self._past(text, limit)
        head = text if end is None else text[:end]
        return self.backend.encode(head, add_special_tokens=add_special_tokens).ids[:limit]

    def _exceeds(self, text: str, limit: int) -> bool:
        return self._past(text, limit) is not None

    def _past(self, text: str, limit: int) -> int | None:
        """Where `text`'s tokens pass `limit` for certain: the end of its first pieces of
        `_PIECE_CHARS`, cut before a space, whose tokens pass `limit` by more than the seams
        between pieces can add (a seam stops a merge across it: a token or two). None: it
        may fit (the caller tokenizes it whole, and the engine counts exactly)."""
        if len(text) <= 2 * _PIECE_CHARS:
            return None
        total = start = seams = 0
        while start < len(text):
            end = min(len(text), start + _PIECE_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + 1, end)
                end = space if space > start else end
            total += len(self.backend.encode(text[start:end], add_special_tokens=False).ids)
            if total > limit + _SEAM_TOKENS * seams:
                return end
            seams += 1
            start = end
        return None

    @cached_property
    def fill_in_middle_ids(self) -> tuple[int, int, int] | None:
        """The ids of the vocabulary's fill-in-the-middle tokens (prefix, suffix, middle),
        or None for a model that has none."""
        for names in _FIM_TOKENS:
            ids = [self.token_to_id(name) for name in names]
            if None not in ids:
                return ids[0], ids[1], ids[2]
        return None

    def encode_fill_in_middle(self, prefix: str, suffix: str, limit: int | None = None
                              ) -> list[int]:
        """A fill-in-the-middle prompt: what the tokenizer puts first (a BOS), the prefix
        token and `prefix`, the suffix token and `suffix`, then the middle token, after
        which the model writes the text between them. Raises ValueError for a model
        without such tokens."""
        ids = self.fill_in_middle_ids
        if ids is None:
            raise ValueError("this model's vocabulary has no fill-in-the-middle tokens ("
                             + ", ".join(names[0] for names in _FIM_TOKENS) + ", ...)")
        start, hole, middle = ids
        head = self.encode("", add_special_tokens=True)
        prompt = [*head, start, *self.encode(prefix, False, limit), hole,
                  *self.encode(suffix, False, limit), middle]
        if limit is not None and len(prompt) > limit:
            raise PromptTooLong(limit)
        return prompt

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair as one input (a cross-encoder's query and document),
        joined as the tokenizer's post-processor joins pairs (transformers'
        `tokenizer(first, second)`)."""
        return self.backend.encode(first, second, add_special_tokens=True).ids

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
        return compile_chat_template(self.chat_template)

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
                **{**self.special_token_strings(), **kwargs},  # as transformers: kwargs win
            )
        except jinja2.TemplateError as e:  # raise_exception(), the sandbox's refusals
            raise ChatTemplateError(f"chat template error: {e}") from None
        except Exception as e:  # the template is untrusted code: any failure is this request's
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
        if not prompt.isascii() and has_lone_surrogate(prompt):
            raise ChatTemplateError("the rendered prompt is not valid Unicode (a lone "
                                    "surrogate, e.g. from chat_template_kwargs or tools)")
        if tokenize:
            return self.encode(prompt, add_special_tokens=False)
        return prompt

    def special_token_strings(self) -> dict[str, str]:
        """bos_token/eos_token/... as strings, the variables templates refer to."""
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        strings = {name: self.id_to_token(i) for name, i in named.items() if i is not None}
        return {name: s for name, s in strings.items() if s is not None}


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
