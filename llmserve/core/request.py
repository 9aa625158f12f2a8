"""A request as the scheduler and the KV cache manager track it (pure Python, no tensors).

One `Request` per engine request holds all the core's per-request state: its tokens, its
KV blocks and what the runner has been sent of them, its drafts and its grammar matcher.
The frontend's state (detokenizer, logprobs, output deltas) is the output processor's
`RequestState`.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class RequestTimings:
    """Wall-clock times (time.time()) of a request's life; TTFT and TPOT derive from them."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(eq=False)  # identity semantics: requests are compared and removed by object
class Request:
    """Token state of one sequence: `| prompt | output |`, of which `num_computed_tokens` have KV.

    `max_tokens` is resolved (never None) by the engine at admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None
    share_group: str | None = None  # siblings (n > 1, best_of) share prompt blocks
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_tier_cached_tokens: int = 0  # of which read from the KV tier (not memory)
    num_swapped_in_tokens: int = 0  # tokens read back from the tier after preemptions
    num_preemptions: int = 0
    num_preempted_tokens: int = 0  # computed tokens whose KV preemptions freed (recomputed)
    block_hashes: list[bytes] = field(default_factory=list)  # sha256 chain, per full block
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # tokenized bad_words
    # draft tokens to verify in the next step (speculative decoding), past all_token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    num_spec_rounds: int = 0  # steps that verified drafts for it
    num_decode_steps: int = 0  # steps that gave it tokens after its first
    draft_acceptance: float | None = None  # the speculator's running acceptance estimate
    # disaggregated prefill/decode (engine/kv_connector.py): on a prefill engine, the
    # transfer id its prompt's KV goes out under once its first token is sampled; on a
    # decode engine, the header of the transfer it continues from (a TransferredKV: first
    # token, block hashes; the blocks stay with the connector), until it is admitted
    remote_decode: str | None = None
    remote_kv: Any = None
    grammar: Any = None  # structured output: its structured.backend.GrammarMatcher
    # a pooling request (an embedding or class scores from its prompt, nothing sampled):
    # its pooling_params.PoolingParams; `pools_every_position`: its pooling (MEAN, CLS)
    # reads hidden states a prefix-cache hit would skip
    pooling_params: Any = None
    pools_every_position: bool = False
    lora_request: Any = None  # lora_request.LoRARequest: the adapter it runs with
    # a vision-language prompt's images (multimodal.ImageInput: content hash, and the
    # prompt positions `offset .. offset + length - 1` their rows take); they key the
    # blocks over those positions in the prefix cache
    mm_inputs: list = field(default_factory=list)
    # KV: its blocks (core.block_pool.Block) in position order; how many leading full ones
    # were offered to the prefix cache; how many block ids the runner holds (None: the
    # runner holds no row for it, so the next step sends its data)
    blocks: list = field(default_factory=list)
    num_offered_blocks: int = 0
    num_blocks_sent: int | None = None
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.timings = RequestTimings(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (verified drafts after
        the one that ended the request)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]

    @property
    def computes_whole_prompt(self) -> bool:
        """Its output needs every prompt position computed: no prefix-cache hits."""
        return self.sampling_params.prompt_logprobs is not None or self.pools_every_position

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop on token ids and lengths (stop strings are checked on text, by the engine)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
