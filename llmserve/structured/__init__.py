"""Structured output: every generated token obeys a JSON schema, regex, choice or grammar.

* `backend.py`: the grammar-backend interface (compile a request's constraint once, then a
  matcher per request: fill its row of the next-token bitmask, accept tokens, roll back).
* `llguidance_backend.py`: the default backend, llguidance (an Earley parser over the
  tokenizer's tokens; a mask costs ~20-50 us on the default model's 49k-token vocabulary).
* `manager.py`: per engine: compiled grammars cached by (constraint, tokenizer), one
  matcher per request, and each step's masks for the whole batch computed on a worker
  thread while the model runs the forward (`GrammarStage`: they travel in the
  `SchedulerOutput`); the runner applies them as one bitmask op.

Requests without a constraint pay nothing: no mask, no thread work, no copy of the logits.
"""

from llmserve.structured.manager import GrammarStage, GrammarStep, StructuredOutputManager

__all__ = ["GrammarStage", "GrammarStep", "StructuredOutputManager"]
