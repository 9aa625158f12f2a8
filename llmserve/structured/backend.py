"""The interface a grammar backend implements (llguidance today; xgrammar could too)."""

import torch

from llmserve.sampling_params import StructuredOutputsParams


class GrammarMatcher:
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 (rows, vocab / 32)
        bitmask (bit t % 32 of word t // 32 set: token t allowed)."""
        raise NotImplementedError

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar did not allow it."""
        raise NotImplementedError

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here (no change)."""
        n = 0
        while n < len(token_ids) and not self.is_terminated and \
                self.accept_token(token_ids[n]):
            n += 1
        if n:
            self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""
        raise NotImplementedError

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token: the request ends here."""
        raise NotImplementedError

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working (its budget spent, a backend fault), one line;
        None while it works."""
        return None


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary; makes matchers."""

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar of `params` (cache it: equal params compile once); raises
        `ValueError` naming the problem for an invalid or unsupported constraint."""
        raise NotImplementedError

    def matcher(self, grammar: object) -> GrammarMatcher:
        raise NotImplementedError

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
                      parallel: bool = False) -> None:
        """Row i of `bitmask` for matchers[i], the batch at once (`parallel`: spread over
        the backend's threads, where it has any)."""
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
