"""Per engine: the requests' matchers, and each step's masks, computed beside the forward."""

import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from llmserve.core.outputs import SchedulerOutput
from llmserve.core.request import Request
from llmserve.core.stage import StepStage
from llmserve.kernels import native_for, ptr
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.backend import GrammarBackend, GrammarMatcher
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


MaskKey = tuple[str, int]  # (request id, j): its mask after j of its drafts


class GrammarStep:
    """This step's masks: row i of the bitmask for `keys[i]`, being computed on the
    manager's thread until `apply` needs it."""

    def __init__(self, keys: list[MaskKey], bitmask: torch.Tensor, done: Future) -> None:
        self.keys = keys
        self.bitmask = bitmask
        self.done = done

    def apply(self, logits: torch.Tensor, keys: list[MaskKey],
              copy: bool = True) -> torch.Tensor:
        """`logits` (N, V), row i at `keys[i]`, with every token the grammars forbid at
        -inf: a copy when the raw logits are still needed (logprobs), else in place (a
        copy of 16 rows of the default model's vocabulary is ~0.15 ms of a ~19 ms
        step)."""
        self.done.result()
        index = {key: i for i, key in enumerate(keys)}
        rows = torch.tensor([index[key] for key in self.keys], dtype=torch.int64)
        lib = native_for(logits)
        if lib is not None:
            # numpy's copy: a torch clone of this size runs an OpenMP region whose idle
            # worker then competes with the native kernels' threads (measured: the batch-1
            # step 3.1 -> 8 ms with a constrained request)
            masked = torch.from_numpy(logits.numpy().copy()) if copy else logits
            lib.apply_token_bitmask(ptr(masked), masked.shape[1], ptr(self.bitmask),
                                    len(rows), ptr(rows))
            return masked
        # torch: bit t % 32 of word t // 32 is token t, the little-endian bits of the bytes
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1,
                             count=logits.shape[-1], bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool).to(logits.device)  # (R, V)
        rows = rows.to(logits.device)
        masked = logits.clone() if copy else logits
        masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return masked


class StructuredOutputManager:
    """Compiles constraints (cached), gives each constrained request a matcher, and computes
    the batch's masks on one worker thread while the model runs."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the backend is built once, from whichever thread

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:  # built on the first constrained request (~0.2 s)
                from llmserve.structured.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self.tokenizer, self.vocab_size)
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="llmserve-grammar")
            return self._backend

    def prepare(self, params: StructuredOutputsParams, count: int = 1
                ) -> list[GrammarMatcher]:
        """`count` matchers for a new request (one per sequence), ready to run: the
        constraint compiled and each matcher's first mask computed, where a hostile
        constraint's work is (its lexer built, its first expressions derived). The server
        calls this on its grammar pool, under a time budget, so that none of that work
        runs on the engine thread; `ValueError` naming the field if the constraint is
        invalid, cannot be enforced, or is over the parser's budget."""
        grammar = self.backend.compile(params)
        scratch = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        matchers = []
        for _ in range(count):
            inner = self.backend.matcher(grammar)
            inner.fill_bitmask(scratch, 0)
            error = getattr(inner, "error", None)
            if error is not None:
                raise ValueError(f"structured_outputs.{params.kind} cannot be enforced: "
                                 f"{error}")
            matchers.append(self._deferred(inner, params))
        return matchers

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for a new request, compiled on the calling thread (`prepare`
        does it off the engine thread); `ValueError` naming the problem if the constraint
        is invalid or cannot be enforced. With `starts_after`, the constraint waits for
        that text in the output (`DeferredMatcher`)."""
        return self._deferred(self.backend.matcher(self.backend.compile(params)), params)

    def _deferred(self, matcher: GrammarMatcher,
                  params: StructuredOutputsParams) -> GrammarMatcher:
        if params.starts_after:
            from llmserve.structured.deferred import DeferredMatcher

            return DeferredMatcher(matcher, self.tokenizer, params.starts_after)
        return matcher

    def start_step(self, matchers: dict[str, GrammarMatcher],
                   drafts: dict[str, list[int]] | None = None) -> GrammarStep | None:
        """The masks of the requests sampled this step (by id): computed on the worker
        thread, beside the forward, when cores are free for it; else at once, on this
        thread. A request with drafts (`drafts[id]`, speculative decoding) gets a mask
        at each of them too: its matcher is advanced through them and rolled back.

        Measured on 2 cores running 2 compute threads (one constrained request, batch-1
        step 3.1 ms): the worker thread or llguidance's executor added 0.1 ms a step (a
        thread hand-off, and a core taken from the model's parallel regions), a mask
        computed here 6-20 us.
        """
        if not matchers:
            return None
        drafts = drafts or {}
        if any(drafts.get(rid) for rid in matchers):
            return self._step_with_drafts(matchers, drafts)
        keys = [(rid, 0) for rid in matchers]
        bitmask = torch.zeros(len(keys), (self.vocab_size + 31) // 32, dtype=torch.int32)
        done: Future = Future()
        if (os.cpu_count() or 1) > torch.get_num_threads() + 1:
            done = self._thread.submit(self.backend.fill_bitmasks, list(matchers.values()),
                                       bitmask, True)
        else:
            self.backend.fill_bitmasks(list(matchers.values()), bitmask)
            done.set_result(None)
        return GrammarStep(keys, bitmask, done)

    def _step_with_drafts(self, matchers: dict[str, GrammarMatcher],
                          drafts: dict[str, list[int]]) -> GrammarStep:
        """Masks at each request's next token and after each of its drafts, in order,
        inline (each matcher's positions follow one another). Drafts were cut to what the
        grammar allows when proposed (`GrammarMatcher.num_valid`), so the matcher accepts
        them."""
        keys = [(rid, j) for rid in matchers for j in range(len(drafts.get(rid, ())) + 1)]
        bitmask = torch.zeros(len(keys), (self.vocab_size + 31) // 32, dtype=torch.int32)
        row = 0
        for rid, matcher in matchers.items():
            request_drafts = drafts.get(rid, [])
            matcher.fill_bitmask(bitmask, row)
            for token in request_drafts:
                matcher.accept_token(token)
                row += 1
                matcher.fill_bitmask(bitmask, row)
            row += 1
            if request_drafts:
                matcher.rollback(len(request_drafts))
        done: Future = Future()
        done.set_result(None)
        return GrammarStep(keys, bitmask, done)


class GrammarStage(StepStage):
    """Structured output attached at the scheduler's edge (`StepStage`): once a step is
    scheduled, the bitmask rows of its constrained requests that sample (at each of their
    drafts too) start computing, and travel in `SchedulerOutput.grammar` to the runner."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager

    def after_schedule(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        matchers = {s.request_id: request.grammar for s in out.scheduled
                    if s.sample and (request := requests.get(s.request_id)) is not None
                    and request.grammar is not None}
        out.grammar = self.manager.start_step(
            matchers, {s.request_id: s.spec_token_ids for s in out.scheduled
                       if s.spec_token_ids})
