"""The one contract of a step, as plain data: what the scheduler asks for and what comes back.

    scheduler.schedule() -> SchedulerOutput -> executor.execute_model() -> ModelRunnerOutput
                                                                        -> scheduler.update()

`SchedulerOutput` carries everything a step needs: the scheduled tokens and new block ids
(`ScheduledRequest`, a request's data once as `NewRequestData`), blocks to copy, KV to load
or save by block id (disaggregated prefill), draft tokens to verify
(`ScheduledRequest.spec_token_ids`) and how many to propose after sampling (`num_drafts`),
and the grammar bitmask rows of the requests it samples (`grammar`). No KV tensor rides in
it; the bitmask is the one array (computed beside the forward, see `structured/manager.py`).

`ModelRunnerOutput` is indexed like the batch: row i is `SchedulerOutput.scheduled[i]`.
"""

from dataclasses import dataclass, field, replace
from typing import Any

from llmserve.core.request import Request
from llmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """What the runner keeps of a request, sent the first step it is scheduled (and again
    the first step after a preemption, which drops the runner's row)."""

    request_id: str
    prompt_token_ids: list[int]  # read-only view; never changes
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table at this step
    output_token_ids: list[int] = field(default_factory=list)  # a copy, for a resumed one
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # a pooling request: its PoolingParams (the runner pools its prompt, samples nothing)
    pooling_params: Any = None
    lora_request: Any = None  # its LoRA adapter (a LoRARequest), None: the base model
    mm_inputs: list = field(default_factory=list)  # its images (`Request.mm_inputs`)


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
    # speculative decoding: once the step has sampled, propose up to this many drafts for
    # the next step (the speculator's policy; the runner's proposer makes them)
    num_drafts: int = 0
    # ... and stop a chain before a draft whose chance of being right, by the proposer's
    # own estimate, falls below this (`Speculator.min_chance`: what one more draft costs
    # against what it is expected to bring; 0: no cut)
    draft_min_chance: float = 0.0
    # ... and keep a draft it has made down to this chance (`Speculator.keep_chance`: its
    # verification only, the proposer's step being paid)
    draft_keep_chance: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)


@dataclass
class KVLoad:
    """Disaggregated decode: the prompt KV of transfer `transfer_id` goes into `block_ids`
    before the forward; `first_token` (the prefill engine's sample) is taken as this
    step's token for the request."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    first_token: int


@dataclass
class KVSave:
    """Disaggregated prefill: once this step samples the request's first token, its
    prompt's blocks `block_ids` (with their chain hashes) go to the decode engine under
    `transfer_id`."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class TierLoad:
    """KV tier: the blocks stored under `block_hashes` go into the request's fresh blocks
    `block_ids` before the forward; the request computes nothing this step, and continues
    after the blocks that arrived (`ModelRunnerOutput.tier_loaded`), recomputing the rest."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    finished_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    # rows the runner drops (a resumed request is sent as new); its seeded generator stays
    preempted_request_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), first
    num_preempted: int = 0
    kv_loads: list[KVLoad] = field(default_factory=list)  # written before the forward
    kv_saves: list[KVSave] = field(default_factory=list)  # sent after sampling
    # KV tier (kv_tier/): blocks read in before the forward; (block id, hash) of the blocks
    # this step fills, kept in the tier after the forward
    tier_loads: list[TierLoad] = field(default_factory=list)
    tier_saves: list[tuple[int, bytes]] = field(default_factory=list)
    # the grammar bitmask rows of the constrained requests sampled this step (a
    # structured.GrammarStep: rows keyed by (request id, draft j)); None: none constrained
    grammar: Any = None
    # images (multimodal.ImageInput) whose rows requests wait for, to encode a slice of
    # beside this step's tokens, first asked first; hashes of rows or encodes in progress
    # to drop after the step (core/image_encodes.py)
    encode_images: list[Any] = field(default_factory=list)
    drop_images: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def for_workers(self) -> "SchedulerOutput":
        """What a tensor-parallel worker needs (it samples nothing: no grammar masks)."""
        return self if self.grammar is None else replace(self, grammar=None)


@dataclass
class ModelRunnerOutput:
    """One step's results, row i for `req_ids[i]` (== `scheduled[i].request_id`).

    `sampled_token_ids[i]`: the row's new tokens, its accepted drafts then one sampled
    token; [] for a prefill chunk that samples nothing. `logprobs[i]`: the raw logprobs
    (worker.logprobs.PositionLogprobs) of each of them, for rows asking for logprobs, else
    None. `prompt_logprobs[i] = (first, positions)`: positions[j] scores prompt token
    `first + j` (first >= 1; a chunked prompt arrives over several steps), else None.
    `pooler_output[i]`: a pooling request's output (a float32 CPU tensor: its embedding or
    class scores) at the step its prompt's last chunk ran, else None.
    `tier_loaded[request_id]`: how many leading blocks of its `TierLoad` arrived intact;
    `tier_load_seconds`: the step's time reading them. `encoded_images`: the hashes of
    the asked images (`SchedulerOutput.encode_images`) whose rows are ready.
    `draft_token_ids[i]`: the drafts proposed after this step for row i to verify in its
    next one (asked for by `ScheduledRequest.num_drafts`), else []; `draft_seconds`: the
    step's time proposing them.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Any] | None] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, list[Any]] | None] = field(default_factory=list)
    pooler_output: list[Any] = field(default_factory=list)
    tier_loaded: dict[str, int] = field(default_factory=dict)
    tier_load_seconds: float = 0.0
    encoded_images: list[str] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    draft_seconds: float = 0.0

    @classmethod
    def empty(cls, req_ids: list[str]) -> "ModelRunnerOutput":
        n = len(req_ids)
        return cls(list(req_ids), [[] for _ in range(n)], [None] * n, [None] * n, [None] * n,
                   draft_token_ids=[[] for _ in range(n)])

    @classmethod
    def from_sampled(cls, out: SchedulerOutput,
                     sampled: dict[str, list[int]]) -> "ModelRunnerOutput":
        """Rows of `out` with the given new tokens (fakes of the model in tests)."""
        result = cls.empty([s.request_id for s in out.scheduled])
        for i, request_id in enumerate(result.req_ids):
            result.sampled_token_ids[i] = list(sampled.get(request_id, []))
        return result


@dataclass
class RequestUpdate:
    """What a step did to one request, for the output processor: it got new tokens
    (appended to `request.output_token_ids`) and/or prompt logprobs, with their raw
    logprobs from the runner; or, a pooling request, its output (`pooled`)."""

    request: Request
    new_tokens: bool
    logprobs: list[Any] | None = None
    prompt_logprobs: tuple[int, list[Any]] | None = None
    pooled: Any = None
