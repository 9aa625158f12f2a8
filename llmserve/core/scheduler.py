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
by the proposer stage) is scheduled with them after its last token,

    | computed | last token | drafts (unverified) |
    0    num_computed      num_tokens       num_tokens + k

and slots for all of them; `update` then keeps the accepted drafts and rolls
`num_computed_tokens` back past the rejected ones (their slots are overwritten later).
Block hashes come only from verified tokens, so no unverified token reaches the prefix
cache.

KV tier (`kv_tier/`): a waiting request whose prompt continues, past its memory hits, in
blocks the tier holds is admitted with fresh blocks for them and a `TierLoad`, and
computes nothing that step; `update` then counts the blocks that arrived as computed and
the request prefills the rest from the next step. A preempted request resumes the same way
when its blocks are worth reading back (`ResumeCost`: `--preemption-mode`). The blocks a
step fills go to the tier as `tier_saves`.

The scheduler touches no tensors: `SchedulerOutput` is its only contract with the runner
(`core/outputs.py`). The runner keeps one row per request it holds, so a request's data
goes to it once (`NewRequestData`, again after a preemption); later steps carry only its
tokens, start position and new block ids, and finished or preempted ids tell it which rows
to drop. Features attach as `StepStage`s (`core/stage.py`), called at the step's edges.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmserve.config.engine import SCHEDULING_POLICIES
from llmserve.core.image_encodes import ImageEncodes
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.outputs import (
    KVLoad,
    KVSave,
    ModelRunnerOutput,
    NewRequestData,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
    TierLoad,
)
from llmserve.core.preemption import ResumeCost
from llmserve.core.request import Request, RequestStatus
from llmserve.core.stage import StepStage

logger = logging.getLogger(__name__)

__all__ = ["NewRequestData", "ScheduledRequest", "Scheduler", "SchedulerConfig",
           "SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    # or "priority": lower value runs first, ties by arrival; or "static" (batch by batch)
    policy: str = "fcfs"
    # the most LoRA adapters the running requests may use at once (0: no adapters)
    max_loras: int = 0
    # a chunk never ends inside an image: the model's image tokens attend to each other
    # both ways (Gemma 3), so an image's keys must all be there when its queries run
    whole_images: bool = False
    # free slots kept after each sampling chunk: an EAGLE head writes its draft chain's
    # K/V there before the drafts are verified (spec_decode/eagle.py)
    num_lookahead_tokens: int = 0

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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 stages: Sequence[StepStage] = (), resume_cost: ResumeCost | None = None
                 ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.resume_cost = resume_cost or ResumeCost()
        self.stages = list(stages)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.last_scheduled_ids: list[str] = []  # the latest step's requests
        self.num_preemptions = 0
        # prompt tokens computed here (not prefix-cache hits, not transferred KV)
        self.num_prefill_computed_tokens = 0
        self._step_prefill_tokens = 0  # of the step in flight
        self._scheduled_at = 0.0  # when the step in flight was handed to the runner
        # static policy: the unfinished members of the batch being run (empty: none runs)
        self.batch: set[Request] = set()
        self.images = ImageEncodes()  # the images' rows the runner holds or encodes
        # pipeline parallelism: steps in flight per request (`begun` ... `finished`), and
        # requests ended meanwhile whose rows the runner drops once their steps finish
        self._in_flight: dict[str, int] = {}
        self._ended_in_flight: set[str] = set()

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
        for stage in self.stages:
            stage.before_schedule(self.running, self._finished_ids)
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget <= 0:  # (a whole image may take a step past the budget)
                break
            if request not in self.running:
                continue  # preempted earlier in this step to make room
            budget -= self._schedule_running(request, budget, out)
        if self.config.policy == "static" and not self.batch:
            self.batch = self._next_batch()
        if out.num_preempted == 0:
            self._schedule_waiting(budget, out)
        out.preempted_request_ids, self._preempted_ids = self._preempted_ids, set()
        self._finish_output(out)
        for stage in self.stages:
            stage.after_schedule(out, self.requests)
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule the request's next tokens, preempting for blocks; returns the budget used.

        The victim is the lowest-priority running request even if it was already scheduled
        this step (decodes go first, so it may be): its tokens are then given back, and the
        result is negative when it gave back more than this request took.
        """
        num_left = request.num_tokens - request.num_computed_tokens
        num_new = self._chunk(request, request.num_computed_tokens, min(num_left, budget))
        if num_new == 0:
            return 0  # nothing to compute until its last step's token comes back
        spec = request.spec_token_ids[: max(0, budget - num_new)] if num_new == num_left else []
        request.spec_token_ids = []
        end = request.num_computed_tokens + num_new + len(spec)
        lookahead = self._lookahead(end) if num_new == num_left else 0
        num_returned = 0
        while not self.kv.allocate_slots(request, num_new + len(spec), num_lookahead=lookahead):
            if lookahead:  # the tokens' slots first; the draft chain's only if they fit
                lookahead = 0
                continue
            # never a request a step in flight computes for (its row and blocks are that
            # step's until it finishes): this one too, when an earlier chunk of it is
            candidates = [r for r in self.running if r.request_id not in self._in_flight]
            if not candidates:
                return -num_returned  # it waits for a step in flight to finish
            victim = max(candidates, key=self._priority_key)
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
            if not self._adapter_fits(request):
                break  # wait until a running request's adapter is done
            hits, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv.get_computed_blocks(request)
                if self.kv.waits_for_load(request, len(hits)):
                    break  # its next blocks arrive this step, for another request
                tier_hashes = self._tier_hashes(request, len(hits))
                if tier_hashes:
                    if not self._admit_loading(request, hits, tier_hashes, out):
                        break
                    continue
            num_new = self._chunk(request, num_hit, min(request.num_tokens - num_hit, budget))
            end = num_hit + num_new
            lookahead = self._lookahead(end) if end == request.num_tokens else 0
            if not self.kv.allocate_slots(request, num_new, hits, lookahead) and not (
                    lookahead and self.kv.allocate_slots(request, num_new, hits)):
                break  # wait for running requests to free blocks
            self._admit(request, num_hit)
            if num_new:  # (else it runs once its image is encoded)
                self._emit(request, num_new, out)
                budget -= num_new

    def _lookahead(self, end: int) -> int:
        """Slots after a sampling chunk that ends at position `end`, for a draft chain's
        K/V (`SchedulerConfig.num_lookahead_tokens`), within the context."""
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - end))

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, stopping short of the first image whose rows
        the runner does not hold yet (which is asked for: `ImageEncodes`); and where the
        model's images must be computed whole (`SchedulerConfig.whole_images`) and the
        chunk would end inside one: up to that image when the chunk starts before it,
        else through its end (past the budget by less than an image)."""
        if not request.mm_inputs or num_new == 0:
            return num_new
        end = start + num_new
        for image in request.mm_inputs:  # in prompt order
            image_end = image.offset + image.length
            if image_end <= start:
                continue
            if image.offset >= end:
                break
            if not self.images.ready(image):
                return max(0, image.offset - start)
            if self.config.whole_images and end < image_end:
                return image.offset - start if image.offset > start else image_end - start
        return num_new

    def _admit(self, request: Request, num_hit: int) -> None:
        """The head of the waiting queue runs, its first `num_hit` tokens found in memory
        (counted as prefix-cache hits at its first admission)."""
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

    def _tier_hashes(self, request: Request, num_memory_blocks: int) -> list[bytes]:
        """The tier's blocks to read for a request being admitted: all it holds for a new
        one; for a resumed one (preempted), those, when reading pays (`ResumeCost`)."""
        found = self.kv.get_tier_hashes(request, num_memory_blocks)
        if request.status == RequestStatus.WAITING:
            self.kv.record_tier_lookup(request, num_memory_blocks, len(found))
            return found
        return found if found and self.resume_cost.swap_pays(len(found)) else []

    def _admit_loading(self, request: Request, hits: list, tier_hashes: list[bytes],
                       out: SchedulerOutput) -> bool:
        """Admit a request with its memory hits and fresh blocks for the tier's blocks,
        read in before the forward (`TierLoad`); it computes nothing this step. False: no
        room."""
        if not self.kv.allocate_for_load(request, hits, len(tier_hashes)):
            return False
        self._admit(request, len(hits) * self.kv.block_size)
        out.tier_loads.append(TierLoad(request.request_id,
                                       self.kv.block_ids(request, len(hits)), tier_hashes))
        return True

    def _finish_loads(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The blocks of each `TierLoad` that arrived count as computed (the rest are
        recomputed); for a new request they are prefix-cache hits, from the tier."""
        self.kv.loading.clear()
        num_blocks = 0
        for load in out.tier_loads:
            request = self.requests.get(load.request_id)
            num_loaded = result.tier_loaded.get(load.request_id, 0)
            num_blocks += num_loaded
            if request is None:
                continue  # aborted in between
            self.kv.finish_load(request, num_loaded)
            num_tokens = num_loaded * self.kv.block_size
            request.num_computed_tokens += num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens += num_tokens
                request.num_tier_cached_tokens += num_tokens
                self.kv.num_tier_hit_tokens += num_tokens
            else:
                request.num_swapped_in_tokens += num_tokens
        self.resume_cost.observe_load(num_blocks, result.tier_load_seconds)

    def _adapter_fits(self, request: Request) -> bool:
        """Admitting `request` keeps the running requests within `max_loras` adapters."""
        lora = request.lora_request
        if lora is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id in running or len(running) < self.config.max_loras

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
        out.kv_loads.append(KVLoad(request.request_id, transfer.transfer_id,
                                   self.kv.block_ids(request), transfer.first_token))
        return True

    def _emit(self, request: Request, num_new: int, out: SchedulerOutput,
              spec: list[int] | None = None) -> None:
        """Schedule tokens [num_computed, num_computed + num_new) and the drafts `spec`
        after them: the request's data if the runner holds no row for it, else only the
        block ids it has not seen."""
        start = request.num_computed_tokens
        end = start + num_new
        num_blocks = len(request.blocks)
        num_sent = request.num_blocks_sent
        new = None
        if num_sent is None:
            new = NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(request),
                output_token_ids=list(request.output_token_ids),
                eos_token_ids=request.eos_token_ids,
                bad_words_token_ids=request.bad_words_token_ids,
                pooling_params=request.pooling_params,
                lora_request=request.lora_request,
                mm_inputs=request.mm_inputs,
            )
            num_sent = num_blocks
        request.num_blocks_sent = num_blocks
        out.scheduled.append(ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            new_block_ids=self.kv.block_ids(request, num_sent),
            sample=end == request.num_tokens,
            new=new,
            spec_token_ids=spec or [],
        ))
        request.num_computed_tokens = end + len(spec or ())

    def _finish_output(self, out: SchedulerOutput) -> None:
        """What the step's final batch implies: prompt tokens computed, prompts whose KV
        goes to a decode engine once their first token is sampled."""
        self.images.finish_output(out, self.requests.values())
        # the step's requests: those it computes for and those whose images it encodes
        self.last_scheduled_ids = [s.request_id for s in out.scheduled]
        if out.encode_images:
            asked = {image.hash for image in out.encode_images}
            self.last_scheduled_ids += [
                r.request_id for r in self.requests.values()
                if r.request_id not in self.last_scheduled_ids
                and any(image.hash in asked for image in r.mm_inputs)]
        out.tier_saves = self.kv.take_filled_blocks()
        self._step_prefill_tokens = 0
        for s in out.scheduled:
            request = self.requests[s.request_id]
            end = min(s.start_position + len(s.token_ids), request.num_prompt_tokens)
            self._step_prefill_tokens += max(0, end - s.start_position)
            if s.sample and request.remote_decode is not None and \
                    request.num_output_tokens == 0:
                num_blocks = -(-request.num_prompt_tokens // self.kv.block_size)
                out.kv_saves.append(KVSave(
                    request.request_id, request.remote_decode,
                    self.kv.block_ids(request)[:num_blocks],
                    list(request.block_hashes[:num_blocks])))
        self.num_prefill_computed_tokens += self._step_prefill_tokens
        self._scheduled_at = time.perf_counter()

    # ---- steps in flight (pipeline parallelism) ----------------------------------------

    def begun(self, out: SchedulerOutput) -> None:
        """`out` is in flight: its requests are not preempted until it finishes (decodes
        are not scheduled again anyway: their next token is not known)."""
        for s in out.scheduled:
            self._in_flight[s.request_id] = self._in_flight.get(s.request_id, 0) + 1

    def finished(self, out: SchedulerOutput) -> None:
        """`out` finished (before `update(out, ...)`): requests that ended while it was in
        flight (an abort) now leave the runner's rows with the next step. A freed
        request's blocks may have gone to a later step meanwhile: each stage runs the
        steps in order, so the later step's K/V is written after this one's."""
        for s in out.scheduled:
            left = self._in_flight.pop(s.request_id) - 1
            if left:
                self._in_flight[s.request_id] = left
            elif s.request_id in self._ended_in_flight:
                self._ended_in_flight.discard(s.request_id)
                self._finished_ids.add(s.request_id)

    # ---- after the forward pass --------------------------------------------------------

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Append each request's new tokens (its accepted drafts, then one sampled token),
        stopping at the first that ends it (finished ones are freed); returns what changed
        for each request that got tokens or prompt logprobs, in batch order."""
        now = time.time()
        self.resume_cost.observe_step(self._step_prefill_tokens,
                                      time.perf_counter() - self._scheduled_at)
        self._finish_loads(out, result)
        self.images.update(result.encoded_images)
        updates = []
        scheduled: list[Request | None] = []  # each row's request (None: aborted since)
        for load in out.kv_loads:
            request = self.requests.get(load.request_id)
            if request is None:
                continue  # aborted in between
            self._append(request, [load.first_token], now)
            updates.append(RequestUpdate(request, new_tokens=True))
        for i, s in enumerate(out.scheduled):
            request = self.requests.get(s.request_id)
            scheduled.append(request)
            if request is None:
                continue
            if result.pooler_output[i] is not None:  # a pooling request's prompt is done
                request.timings.first_token = request.timings.last_token = now
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                updates.append(RequestUpdate(request, False, pooled=result.pooler_output[i]))
                continue
            tokens = result.sampled_token_ids[i]
            if s.spec_token_ids and tokens:
                num_accepted = len(tokens) - 1
                request.num_spec_rounds += 1
                request.num_draft_tokens += len(s.spec_token_ids)
                request.num_accepted_tokens += num_accepted
                # the rejected drafts' KV is garbage: compute from the first of them again
                request.num_computed_tokens -= len(s.spec_token_ids) - num_accepted
            if tokens:
                request.num_decode_steps += request.num_output_tokens > 0
                self._append(request, tokens, now)
            if tokens or result.prompt_logprobs[i] is not None:
                updates.append(RequestUpdate(request, bool(tokens), result.logprobs[i],
                                             result.prompt_logprobs[i]))
        for stage in self.stages:
            stage.after_update(out, result, scheduled)
        return updates

    def _append(self, request: Request, tokens: list[int], now: float) -> None:
        for token in tokens:
            request.append_output_token(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
                break
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.last_token = now

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
        request.num_blocks_sent = None
        request.spec_token_ids = []  # (it recomputes; the next sample brings new drafts)
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
        request.num_blocks_sent = None
        if request.request_id in self._in_flight:
            self._ended_in_flight.add(request.request_id)
        else:
            self._finished_ids.add(request.request_id)

    def _priority_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)
