"""Token-budget scheduler: continuous batching, chunked prefill, prefix hits, preemption.

Each step hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs`
requests: running decodes first, then running prompts that are part-way through their
prefill, then new requests from the waiting queue (each chunked to what the budget
leaves). When a running request cannot get a block, the lowest-priority running request
(for FCFS: the most recently admitted) is preempted: its blocks are freed and it goes back
to the front of the waiting queue to be recomputed later. Nothing is ever dropped.

The "static" policy batches statically instead (the baseline continuous batching is
measured against): it admits a batch, the leading waiting requests whose prompts fit the
free blocks (up to `max_num_seqs`), and admits nothing else until every member finished.
Members are admitted in chunks as the budget allows and a preempted member resumes within
its batch; a request arriving meanwhile waits for the next batch.

Speculative decoding: a decoding request with draft tokens (`Request.spec_token_ids`, set
by the engine's proposer) is scheduled with them after its last token,

    | computed | last token | drafts (unverified) |
    0    num_computed      num_tokens       num_tokens + k

and slots for all of them; `update` then keeps the accepted drafts and rolls
`num_computed_tokens` back past the rejected ones (their slots are overwritten later).
Block hashes come only from verified tokens, so no unverified token reaches the prefix
cache.

The scheduler touches no tensors: `SchedulerOutput` is its only contract with the runner.
The runner keeps one row per request it holds, so a request's data goes to it once
(`NewRequestData`, again after a preemption); later steps carry only its tokens, start
position and new block ids, and finished or preempted ids tell it which rows to drop.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.config.engine import SCHEDULING_POLICIES
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request, RequestStatus
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    # or "priority": lower value runs first, ties by arrival; or "static" (batch by batch)
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", not {self.policy!r}")


@dataclass
class NewRequestData:
    """What the runner keeps of a request, sent the first step it is scheduled (and again
    the first step after a preemption, which drops the runner's row)."""

    request_id: str
    prompt_token_ids: list[int]  # read-only view; never changes
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table at this step
    output_token_ids: list[int] = field(default_factory=list)  # a copy; resumed or forked
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions from `start_position`.

    A request the runner already holds brings only the block ids appended to its table
    since it was last scheduled (a held table only grows); one it does not hold brings
    `new`, and its tokens past `new.output_token_ids` are the outputs the runner learns.
    """

    request_id: str
    token_ids: list[int]
    start_position: int  # == num_computed_tokens before this step
    new_block_ids: list[int]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    new: NewRequestData | None = None
    # draft tokens computed after token_ids and verified by sampling at each of them
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    finished_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    # rows the runner drops (a resumed request is sent as new); its seeded generator stays
    preempted_request_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), first
    num_preempted: int = 0
    # disaggregated decode: (block ids, KVBlocks) the runner writes into its cache first,
    # and the first token of each such request (sampled by the prefill engine)
    kv_loads: list[tuple[list[int], Any]] = field(default_factory=list)
    remote_first_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._blocks_to_copy: list[tuple[int, int]] = []
        self._preempted_ids: set[str] = set()
        # requests the runner holds a row for -> how many of their block ids it has
        self._num_blocks_sent: dict[str, int] = {}
        self.num_preemptions = 0
        # static policy: the unfinished members of the batch being run (empty: none runs)
        self.batch: set[Request] = set()

    # ---- admission and removal -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.config.policy == "priority":
            self.waiting.sort(key=self._priority_key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, or a stop string found by the engine) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request, status)
        return request

    def fork(self, parents: list[Request], children: list[tuple[Request, Request]]) -> None:
        """Replace `parents` by `(child, parent)` continuations sharing the parents' blocks.

        A child whose parent holds no blocks (it was preempted) is recomputed from scratch.
        Blocks a child will write into are made private (copy-on-write) before the parents'
        references are dropped; the copies run before the next forward pass.
        """
        for child, parent in children:
            self.requests[child.request_id] = child
            if parent in self.batch:
                self.batch.add(child)
            if parent in self.running:
                self.kv.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:
                child.num_computed_tokens = 0
                child.status = RequestStatus.PREEMPTED
                self.waiting.insert(0, child)
        for parent in parents:
            self.finish_request(parent.request_id, RequestStatus.FINISHED_ABORTED)
        for child, _ in children:
            if child.status == RequestStatus.RUNNING:
                self._make_private(child)

    def _make_private(self, request: Request) -> None:
        try:
            copy = self.kv.make_last_block_private(request)
        except ValueError:  # no block for the copy: recompute this beam later instead
            self._preempt(request)
            return
        if copy is not None:
            self._blocks_to_copy.append(copy)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(
            finished_request_ids=self._finished_ids, blocks_to_copy=self._blocks_to_copy
        )
        self._finished_ids, self._blocks_to_copy = set(), []
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this step to make room
            budget -= self._schedule_running(request, budget, out)
        if self.config.policy == "static" and not self.batch:
            self.batch = self._next_batch()
        if out.num_preempted == 0:
            self._schedule_waiting(budget, out)
        out.preempted_request_ids, self._preempted_ids = self._preempted_ids, set()
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule the request's next tokens, preempting for blocks; returns the budget used.

        The victim is the lowest-priority running request even if it was already scheduled
        this step (decodes go first, so it may be): its tokens are then given back, and the
        result is negative when it gave back more than this request took.
        """
        num_left = request.num_tokens - request.num_computed_tokens
        num_new = min(num_left, budget)
        if num_new == 0:
            return 0  # a beam waiting for its siblings' results
        spec = request.spec_token_ids[: budget - num_new] if num_new == num_left else []
        request.spec_token_ids = []
        num_returned = 0
        while not self.kv.allocate_slots(request, num_new + len(spec)):
            victim = max(self.running, key=self._priority_key)
            num_returned += self._unschedule(victim, out)
            self._preempt(victim)
            out.num_preempted += 1
            if victim is request:
                return -num_returned
        self._emit(request, num_new, out, spec)
        return num_new + len(spec) - num_returned

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.config.policy == "static" and request not in self.batch:
                break  # the batch's members not yet admitted lead the queue
            if request.remote_kv is not None:
                if not self._admit_prefilled(request, out):
                    break
                continue
            hits, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break  # wait for running requests to free blocks
            self.waiting.pop(0)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
                if self.kv.shares_blocks(request):
                    self.kv.record_lookup(request.num_tokens, num_hit)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = time.time()
            self.running.append(request)
            self._emit(request, num_new, out)
            budget -= num_new

    def _next_batch(self) -> set[Request]:
        """Static policy: the leading waiting requests, up to `max_num_seqs`, whose prompts
        fit the free blocks together (prefix hits not counted); the first one always (the
        engine refuses a request larger than the whole cache). Members' decodes may still
        run out of blocks: a preempted member resumes within the batch."""
        batch: set[Request] = set()
        num_free = self.kv.pool.num_free_blocks
        for request in self.waiting[: self.config.max_num_seqs]:
            num_blocks = -(-request.num_tokens // self.kv.block_size)
            if batch and num_blocks > num_free:
                break
            batch.add(request)
            num_free -= num_blocks
        return batch

    def _admit_prefilled(self, request: Request, out: SchedulerOutput) -> bool:
        """Admit a request whose prompt a prefill engine computed: fresh blocks that the
        runner fills with the transferred KV, its first token as if sampled this step, and
        nothing to compute now (the next step decodes from that token). False: no room."""
        transfer = request.remote_kv
        request.num_computed_tokens = request.num_tokens  # the whole prompt has its KV
        if not self.kv.allocate_slots(request, 0):
            request.num_computed_tokens = 0
            return False
        self.waiting.pop(0)
        request.remote_kv = None  # a preempted request recomputes its prompt
        request.status = RequestStatus.RUNNING
        request.timings.first_scheduled = time.time()
        self.running.append(request)
        if request.cache_salt is None and transfer.block_hashes != request.block_hashes[
                : len(transfer.block_hashes)]:  # same tokens, same chain: never expected
            logger.warning("%s: the prefill server's block hashes differ from this "
                           "server's; its blocks are cached under this server's",
                           request.request_id)
        out.kv_loads.append((self.kv.block_ids(request.request_id), transfer.blocks))
        out.remote_first_tokens[request.request_id] = transfer.first_token
        return True

    def _emit(self, request: Request, num_new: int, out: SchedulerOutput,
              spec: list[int] | None = None) -> None:
        """Schedule tokens [num_computed, num_computed + num_new) and the drafts `spec`
        after them: the request's data if the runner holds no row for it, else only the
        block ids it has not seen."""
        start = request.num_computed_tokens
        end = start + num_new
        request_id = request.request_id
        num_blocks = self.kv.num_blocks(request_id)
        num_sent = self._num_blocks_sent.get(request_id)
        new = None
        if num_sent is None:
            new = NewRequestData(
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(request_id),
                output_token_ids=list(request.output_token_ids),
                eos_token_ids=request.eos_token_ids,
                bad_words_token_ids=request.bad_words_token_ids,
            )
            num_sent = num_blocks
        self._num_blocks_sent[request_id] = num_blocks
        out.scheduled.append(
            ScheduledRequest(
                request_id=request_id,
                token_ids=request.all_token_ids[start:end],
                start_position=start,
                new_block_ids=self.kv.block_ids(request_id, num_sent),
                sample=end == request.num_tokens,
                new=new,
                spec_token_ids=spec or [],
            )
        )
        request.num_computed_tokens = end + len(spec or ())

    # ---- after the forward pass --------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens (its accepted drafts, then one sampled token),
        stopping at the first that ends it; return the requests that got tokens (finished
        ones freed)."""
        now = time.time()
        updated = []
        for request_id, token in out.remote_first_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted in between
            request.append_output_token(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request_id, status)
            request.timings.first_token = request.timings.last_token = now
            updated.append(request)
        for s in out.scheduled:
            tokens = sampled.get(s.request_id)
            request = self.requests.get(s.request_id)
            if not tokens or request is None:
                continue
            if s.spec_token_ids:
                num_accepted = len(tokens) - 1
                request.num_draft_tokens += len(s.spec_token_ids)
                request.num_accepted_tokens += num_accepted
                # the rejected drafts' KV is garbage: compute from the first of them again
                request.num_computed_tokens -= len(s.spec_token_ids) - num_accepted
            for token in tokens:
                request.append_output_token(token)
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            if request.timings.first_token is None:
                request.timings.first_token = now
            request.timings.last_token = now
            updated.append(request)
        return updated

    # ---- helpers -----------------------------------------------------------------------

    def _unschedule(self, request: Request, out: SchedulerOutput) -> int:
        """Take back the request's share of this step, if any; returns its number of tokens.

        Always followed by `_preempt`, which tells the runner to drop the request's row.
        """
        for i, s in enumerate(out.scheduled):
            if s.request_id == request.request_id:
                del out.scheduled[i]
                request.num_computed_tokens = s.start_position
                return s.num_tokens
        return 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._num_blocks_sent.pop(request.request_id, None)
        self._preempted_ids.add(request.request_id)
        request.num_preempted_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        if self.config.policy == "priority":
            self.waiting.sort(key=self._priority_key)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.batch.discard(request)
        request.timings.finished = time.time()
        self.kv.free(request)
        self._num_blocks_sent.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    def _priority_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)
