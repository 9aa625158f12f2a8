"""llguidance as the grammar backend."""

import json
from functools import lru_cache

import llguidance
import torch
from llguidance import regex_to_lark
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

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


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)

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
        return self.matcher.get_error() if self.matcher.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # the model's vocabulary may be padded past the tokenizer's: those ids never allowed
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size,
            eos_token=sorted(tokenizer.stop_token_ids))
        self.executor = llguidance.LLExecutor()
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
                text = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in choice))
            else:
                lark = gbnf_to_lark(grammar) if "::=" in grammar else grammar
                text = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as exc:  # noqa: BLE001 - not JSON, not an object, a GBNF error
            raise ValueError(f"{field}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer)
        if is_error:
            raise ValueError(f"{field} cannot be enforced: {messages[0]}")
        return text

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                      parallel: bool = False) -> None:
        if not parallel or not all(isinstance(m, LLGuidanceMatcher) for m in matchers):
            # on the calling thread: ~6-20 us a mask on the default model; a deferred
            # matcher (structured/deferred.py) fills its own rows
            super().fill_bitmasks(matchers, bitmask)
            return
        # llguidance's executor spreads the rows over its threads (a hand-off to them costs
        # ~0.1 ms: worth it for many rows with cores to spare); it releases the GIL
        fill_next_token_bitmask_par(
            self.executor, [(m.matcher, row) for row, m in enumerate(matchers)], bitmask)
