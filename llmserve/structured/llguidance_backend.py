"""llguidance as the grammar backend."""

import json
import re
from functools import lru_cache

import llguidance
import torch
from llguidance import regex_to_lark
from llguidance.gbnf_to_lark import gbnf_to_lark

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.backend import GrammarBackend, GrammarMatcher
from llmserve.tokenizer import Tokenizer

# separators as `json.dumps` writes them by default (", " and ": "), no other whitespace;
# whitespace_flexible allows any
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ",
                "key_separator": ": "}


# llguidance's own "date" format takes 02-29 in any year; this one knows leap years (a
# proleptic Gregorian year of four digits, as RFC 3339 full-date)
_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
DATE = rf"(?:[0-9]{{4}}-{_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 date-time: upper-case T and Z, seconds 00-59, up to 9 fraction digits
DATE_TIME = (DATE + r"T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
             r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_FORMAT_PATTERNS = {"date": DATE, "date-time": DATE_TIME}

# The grammar budget (llguidance's parser limits): its defaults, but for the fuel that
# builds the lexer's first expressions, which is checked far more slowly than its ~50k/ms
# (a nested repeat, `((a{100}){100}){100}`, spent 1.9 s of a core on its first mask at the
# default 1,000,000; 0.16 s at this); and errors never quote the grammar (they are
# returned to the client and logged)
LIMITS = {"initial_lexer_fuel": 200_000, "verbose_errors": False}
MAX_ERROR_CHARS = 200  # of a compiler or matcher error, in a reply or the log


def strict_date_formats(schema: object) -> object:
    """`schema` with every string `format` of "date" / "date-time" (without a `pattern`)
    turned into an anchored `pattern` that only valid calendar dates match."""
    if isinstance(schema, list):
        return [strict_date_formats(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_date_formats(v) if k not in ("const", "enum", "default", "examples")
           else v for k, v in schema.items()}
    if isinstance(out.get("format"), str) and out["format"] in _FORMAT_PATTERNS \
            and "pattern" not in out:
        out["pattern"] = f"^{_FORMAT_PATTERNS[out.pop('format')]}$"
    return out


def one_line(message: str) -> str:
    """A grammar error as one short line: its lines joined, without those quoting the
    grammar (`   1 | start: ...`), the middle cut where it is longer than MAX_ERROR_CHARS
    (its start says where, its end what: "error: unclosed character class")."""
    lines = [line.strip() for line in message.replace("<non-verbose/>", "").splitlines()]
    text = " ".join(line for line in lines if line and not _QUOTED.match(line))
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    return f"{text[:half]} ... {text[-half:]}"


_QUOTED = re.compile(r"^\d+ \|")  # a line of the grammar, as the compiler quotes it


def choice_regex(choice: tuple[str, ...]) -> str:
    """A regex matching exactly the strings of `choice`: every ASCII character that is not
    a letter or digit escaped as `\\x{..}`. One alternation is one lexeme: compiling it
    grows about linearly in its size, where a Lark rule of one string per alternative grows
    about quadratically (20,000 choices: 0.2 s against 1.4 s)."""
    def escape(c: str) -> str:
        return c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):x}}}"

    return "|".join("".join(escape(c) for c in text) for text in choice)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # llguidance.torch's helper does this; importing it costs ~3 s (torch.compile)
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def num_valid(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return one_line(self.matcher.get_error()) if self.matcher.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # the model's vocabulary may be padded past the tokenizer's: those ids never allowed
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size,
            eos_token=sorted(tokenizer.stop_token_ids))
        self.executor = llguidance.LLExecutor()
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def compile(self, params: StructuredOutputsParams) -> str:
        json_schema = params.json
        if isinstance(json_schema, dict):  # the cache key; properties keep their order
            json_schema = json.dumps(json_schema)
        return self._compile(params.kind, json_schema, params.regex,
                             tuple(params.choice or ()), params.grammar,
                             params.whitespace_flexible)

    def _compile_uncached(self, kind: str, schema: str | None, regex: str | None,
                          choice: tuple[str, ...], grammar: str | None,
                          whitespace_flexible: bool) -> str:
        field = f"structured_outputs.{kind}"
        options = {"whitespace_flexible": True} if whitespace_flexible else COMPACT_JSON
        try:
            if kind == "json":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    strict_date_formats(json.loads(schema)), defaults=options)
            elif kind == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=options)
            elif kind == "regex":
                # \d is an ASCII digit, as users of Python's and JSON schema's regexes
                # expect (llguidance's default is any Unicode digit)
                text = llguidance.LLMatcher.grammar_from_regex(regex_to_lark(regex, "d"))
            elif kind == "choice":
                text = llguidance.LLMatcher.grammar_from_regex(choice_regex(choice))
            else:
                lark = gbnf_to_lark(grammar) if "::=" in grammar else grammar
                text = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # noqa: BLE001 - not JSON, not an object, a GBNF error
            raise ValueError(f"{field}: {one_line(str(exc))}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer, limits=self.limits)
        if is_error:
            raise ValueError(f"{field} cannot be enforced: {one_line(messages[0])}")
        return text

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                                      limits=self.limits))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                      parallel: bool = False) -> None:
        if not parallel or not all(isinstance(m, LLGuidanceMatcher) for m in matchers):
            # on the calling thread: ~6-20 us a mask on the default model; a deferred
            # matcher (structured/deferred.py) fills its own rows
            super().fill_bitmasks(matchers, bitmask)
            return
        # llguidance's executor spreads the rows over its threads (a hand-off to them costs
        # ~0.1 ms: worth it for many rows with cores to spare); it releases the GIL
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        self.executor.unsafe_compute_mask_ptr(
            [(m.matcher, row) for row, m in enumerate(matchers)], bitmask.data_ptr(),
            bitmask.shape[1] * 4, bitmask.shape[0])
