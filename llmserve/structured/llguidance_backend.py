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


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

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
        self.executor = llguidance.LLExecutor(num_threads=1)
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def compile(self, params: StructuredOutputsParams) -> str:
        json_schema = params.json
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema, sort_keys=True)
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
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
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
        except ValueError as exc:  # not valid JSON, or a schema that is not an object
            raise ValueError(f"{field}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.tokenizer)
        if is_error:
            raise ValueError(f"{field} cannot be enforced: {messages[0]}")
        return text

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        # one call for the batch; llguidance releases the GIL while it computes
        fill_next_token_bitmask_par(
            self.executor, [(m.matcher, row) for row, m in enumerate(matchers)], bitmask)
