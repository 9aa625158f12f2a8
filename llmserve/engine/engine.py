"""The engine: admit requests, step the scheduler and the model, turn tokens into outputs.

    step():  scheduler.schedule() -> runner.execute() -> scheduler.update() -> detokenize/stop
             (+ logprobs and prompt logprobs from the runner, decoded into `Logprob`s)
             -> one output per request that progressed, as its `output_kind` asks
                (DELTA: only what is new; FINAL_ONLY: one full output at the end)

Everything the engine holds about a scheduled sequence is one `RequestState` in
`self.states`; n > 1 / best_of groups and beam searches are in `self.groups` under the
caller's id.
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from llmserve.config.engine import EngineConfig, SpeculativeConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmserve.cpu_info import memory_bytes
from llmserve.distributed.kv_transfer import (
    KVBlocks,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    TransferredKV,
    TransferStats,
)
from llmserve.distributed.kv_transfer import connect as kv_connect
from llmserve.engine.beam_search import BeamSearchGroup, BeamSearchRunner
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.parallel_sampling import ParallelGroup
from llmserve.engine.request_state import LogprobsDecoder, RequestState
from llmserve.errors import LLMServeError
from llmserve.executor.executor import Executor, make_executor
from llmserve.executor.ranks import CacheSpec, WorkerSpec
from llmserve.kernels import native, set_num_threads
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache, resolve_kv_cache_dtype
from llmserve.loader.kernel_choice import choose_attention
from llmserve.loader.model_loader import LoadedModel, load_model
from llmserve.memory import parse_size, plan_kv_cache
from llmserve.models.compile import warm_up
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.cost import measure_step_costs
from llmserve.spec_decode.draft_model import DraftModelProposer
from llmserve.spec_decode.speculator import Speculator
from llmserve.structured import StructuredOutputManager
from llmserve.worker.model_runner import ModelRunner, RunnerOutput

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RequestRejected(LLMServeError, ValueError):
    """A request that can never run (too long for the model or the cache)."""


@dataclass
class _NewRequest:
    """A validated prompt waiting to become one or more `Request`s."""

    text: str | None
    ids: list[int]
    max_tokens: int
    priority: int
    arrival_time: float
    cache_salt: str | None


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.executor = self._start_ranks(config, loaded)
        if config.num_threads is not None:
            set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(
            config.model, self.dtype, self.device, config.weight_quantization,
            config.enforce_eager, tp=self.executor.tp if self.executor else None,
        )
        self.tokenizer = self.loaded.tokenizer
        model_cfg = self.loaded.config
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        self.attention_backend_name = self._attention_backend_name(config)
        self.attention = attention_backend(self.device, self.attention_backend_name)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.loaded.quantization,
            self.attention.reads_only_written_slots)
        # under tensor parallelism each rank holds the KV heads of its share (rank 0 the
        # most), and as many blocks as rank 0
        shard = getattr(self.loaded.model, "plan", None)
        num_kv_heads = len(shard.attention.kv_heads) if shard else model_cfg.num_key_value_heads
        plan = plan_kv_cache(model_cfg, self.kv_cache_dtype, self._kv_budget(),
                             config.block_size, num_kv_heads)
        logger.info(
            "KV cache: %d blocks = %d tokens (%.2f GiB, %s); weights: %s, %.0f MiB; "
            "%d threads", plan.num_blocks, plan.num_tokens, plan.total_bytes / 2**30,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.loaded.quantization or str(self.dtype).removeprefix("torch."),
            model_bytes(self.loaded.model) / 2**20, torch.get_num_threads(),
        )
        self.kv_plan = plan
        kv_cache = KVCache.allocate(
            model_cfg.num_hidden_layers, plan.num_blocks, plan.block_size,
            num_kv_heads, model_cfg.head_dim, self.kv_cache_dtype, self.device,
            zeroed=not self.attention.reads_only_written_slots,
        )
        if self.executor is not None:
            self.executor.allocate_caches(CacheSpec(
                plan.num_blocks, plan.block_size, self.kv_cache_dtype,
                self.attention_backend_name, config.max_num_seqs))
        self.kv_manager = KVCacheManager(
            plan.num_blocks, plan.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
            ),
            self.kv_manager,
        )
        self.runner = ModelRunner(self.loaded.model, kv_cache, self.device,
                                  max_num_seqs=config.max_num_seqs, attention=self.attention,
                                  executor=self.executor)
        warm_up(self.loaded.model, kv_cache, self.attention)
        self.states: dict[str, RequestState] = {}  # single requests and siblings, not beams
        self.groups: dict[str, ParallelGroup | BeamSearchGroup] = {}  # by the caller's id
        self.beams = BeamSearchRunner(self.scheduler, self.tokenizer)
        self.step_request_ids: list[str] = []  # what the last step scheduled (engine ids)
        self.logprobs_decoder = LogprobsDecoder(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, model_cfg.vocab_size)
        self.speculator = self._build_speculator(config.speculative_config)
        self._ids = itertools.count()
        # prompt tokens this engine computed (not prefix-cache hits, not transferred KV)
        self.num_prefill_computed_tokens = 0
        self.kv_sender: KVSender | None = None
        self.kv_receiver: KVReceiver | None = None
        if config.kv_role is not None:
            group = kv_connect(KVTransferConfig.parse(config.kv_role,
                                                      config.kv_transfer_address))
            if config.kv_role == "prefill":
                self.kv_sender = KVSender(group)
            else:
                self.kv_receiver = KVReceiver(group)

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: "str | TransferredKV | None" = None,
    ) -> str:
        """Queue a prompt (text, token ids, or {"prompt_token_ids": [...]}); returns its id.

        `n > 1` or `best_of` fan out into sibling requests sharing the prompt's blocks;
        `use_beam_search` runs a beam search group. Either way the caller sees one id.
        `kv_transfer` (disaggregated prefill/decode): on a prefill engine, the transfer id
        the prompt's KV is sent under when the request finishes; on a decode engine, the
        `TransferredKV` it continues from.
        """
        params = params or SamplingParams()
        text, ids = self._tokenize(prompt)
        if kv_transfer is not None:
            self._check_kv_transfer(kv_transfer, ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.states or request_id in self.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        max_tokens = self._check_length(len(ids), params)
        self._check_token_ids(params)
        if params.structured_outputs is not None:
            try:  # compile now (cached): an invalid constraint is refused before it queues
                self.structured.backend.compile(params.structured_outputs)
            except ValueError as e:
                raise RequestRejected(str(e)) from None
        new = _NewRequest(text, ids, max_tokens, priority, arrival_time or time.time(), cache_salt)
        if params.use_beam_search:
            self.groups[request_id] = self.beams.add(request_id, new, params)
        elif params.n > 1 or (params.best_of or 1) > params.n:
            group = ParallelGroup(request_id, params)
            self.groups[request_id] = group
            for i in range(group.best_of):
                self._add_one(group.child_id(i), new, group.child_params(i), group, i)
        else:
            self._add_one(request_id, new, params, kv_transfer=kv_transfer)
        return request_id

    def _check_kv_transfer(self, kv_transfer: "str | TransferredKV", ids: list[int],
                           params: SamplingParams) -> None:
        role = self.config.kv_role
        wanted = "prefill" if isinstance(kv_transfer, str) else "decode"
        if role != wanted:
            raise RequestRejected(f"kv_transfer_params: this server's role is {role or 'none'}"
                                  f", not {wanted}")
        if params.n > 1 or (params.best_of or 1) > 1 or params.use_beam_search:
            raise RequestRejected("kv_transfer_params: only single-sequence requests (n = 1, "
                                  "no best_of, no beam search) are disaggregated")
        if not isinstance(kv_transfer, str) and kv_transfer.prompt_token_ids != ids:
            raise RequestRejected("kv_transfer_params: the prompt differs from the one the "
                                  "prefill server computed")

    def _add_one(
        self, request_id: str, new: "_NewRequest", params: SamplingParams,
        parent: ParallelGroup | None = None, index: int = 0,
        kv_transfer: "str | TransferredKV | None" = None,
    ) -> None:
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        request = Request(
            request_id, new.ids, params, new.max_tokens, stop_ids, new.priority,
            new.cache_salt, share_group=parent.request_id if parent else None,
            arrival_time=new.arrival_time,
        )
        request.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if isinstance(kv_transfer, str):
            request.remote_decode = kv_transfer
        elif kv_transfer is not None:
            request.remote_kv = kv_transfer
        detok = IncrementalDetokenizer(
            self.tokenizer, new.ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output,
        )
        state = RequestState(request, new.text, detok, parent, index)
        if params.structured_outputs is not None:
            state.grammar = self.structured.matcher(params.structured_outputs)
        self.states[request_id] = state
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its KV blocks; returns its final output."""
        group = self.groups.pop(request_id, None)
        if isinstance(group, BeamSearchGroup):
            return self.beams.abort(group)
        if isinstance(group, ParallelGroup):
            for i in range(group.best_of):
                child = self._abort_one(group.child_id(i))
                if child is not None:
                    group.add(i, child)
            return group.output()
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if self.speculator is not None:
            self.speculator.remove(request_id)
        return state.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.states or self.groups)

    def callers_of(self, request_ids: list[str]) -> set[str]:
        """The callers' request ids behind engine request ids (a sibling of n > 1 or a
        beam belongs to its caller's request)."""
        callers = set()
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.parent is not None:
                callers.add(state.parent.request_id)
            elif self.beams.owns(request_id):
                callers.add(self.beams.group_of[request_id].request_id)
            else:
                callers.add(request_id)
        return callers

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step; the outputs (per `output_kind`) of every request
        that got tokens, one per caller's request id."""
        self.step_request_ids = []
        if self.speculator is not None:
            self._propose_drafts()
        out = self.scheduler.schedule()
        self.step_request_ids = [s.request_id for s in out.scheduled]
        grammar = self.structured.start_step({
            s.request_id: state.grammar for s in out.scheduled
            if s.sample and (state := self.states.get(s.request_id)) is not None
            and state.grammar is not None},
            {s.request_id: s.spec_token_ids for s in out.scheduled if s.spec_token_ids})
        self._count_prefill(out)
        runner_out = self.runner.execute(out, grammar)
        self._record_prompt_logprobs(runner_out)
        sampled = {rid: t for rid, t in runner_out.sampled.items() if not self.beams.owns(rid)}
        to_send = self._remote_decodes(out)
        updated = self.scheduler.update(out, sampled)
        if self.speculator is not None:
            for s in out.scheduled:
                if s.spec_token_ids and s.request_id in sampled:
                    self.speculator.record(s.request_id, len(s.spec_token_ids),
                                           len(sampled[s.request_id]) - 1)
        outputs: list[RequestOutput] = []
        groups: dict[str, ParallelGroup] = {}  # groups with a sibling output this step
        for request in updated:
            state = self.states[request.request_id]
            output = self._process(state, runner_out)
            if output is None:
                continue
            if state.parent is None:
                outputs.append(output)
            else:
                state.parent.add(state.index, output)
                groups[state.parent.request_id] = state.parent
        for group in groups.values():
            output = group.output()
            if output is not None:
                outputs.append(output)
                if output.finished:
                    del self.groups[group.request_id]
        for output in self.beams.step({rid: positions[-1] for rid, positions
                                       in runner_out.logprobs.items()}):
            self.groups.pop(output.request_id, None)
            outputs.append(output)
        self._send_kv(to_send)
        return outputs

    # ---- disaggregated prefill/decode ------------------------------------------------------

    def _count_prefill(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            request = self.scheduler.requests.get(s.request_id)
            if request is not None:
                end = min(s.start_position + len(s.token_ids), request.num_prompt_tokens)
                self.num_prefill_computed_tokens += max(0, end - s.start_position)

    def _remote_decodes(self, out: SchedulerOutput) -> list[tuple[Request, list[int]]]:
        """Requests of this step whose KV goes to a decode engine if they finish now, with
        their block ids (taken before `update` frees them)."""
        if self.kv_sender is None:
            return []
        found = []
        for s in out.scheduled:
            request = self.scheduler.requests.get(s.request_id)
            if s.sample and request is not None and request.remote_decode is not None:
                found.append((request, self.kv_manager.block_ids(s.request_id)))
        return found

    def _send_kv(self, candidates: list[tuple[Request, list[int]]]) -> None:
        """Copy the prompt blocks of the requests that finished (their blocks are free but
        untouched until the next forward pass) and queue them for the decode engine."""
        for request, block_ids in candidates:
            if not request.status.finished or request.status == RequestStatus.FINISHED_ABORTED:
                continue
            num_blocks = -(-request.num_prompt_tokens // self.kv_manager.block_size)
            self.kv_sender.send(TransferredKV(
                request.remote_decode, list(request.prompt_token_ids),
                request.output_token_ids[0], list(request.block_hashes[:num_blocks]),
                KVBlocks.gather(self.runner.kv_cache, block_ids[:num_blocks])))

    @property
    def kv_transfer_stats(self) -> "TransferStats | None":
        link = self.kv_sender or self.kv_receiver
        return link.stats if link is not None else None

    def _process(self, state: RequestState, runner_out: RunnerOutput) -> RequestOutput | None:
        """Take the request's new tokens in order (grammar, logprobs, detokenizer, stop
        strings), and build its output. Tokens after one that ends the request (a stop
        string, a complete grammar) are dropped: they were verified drafts past the end."""
        request = state.request
        positions = runner_out.logprobs.get(request.request_id, [])
        new = request.output_token_ids[state.num_processed_tokens:]
        stop = None
        # the scheduler ends a request (eos, length) only at its last new token
        ended_at_last = request.status.finished
        for i, token in enumerate(new):
            state.num_processed_tokens += 1
            grammar_ok = state.grammar is None or self._advance_grammar(state, token)
            if i < len(positions):
                state.add_logprobs(self.logprobs_decoder.entries(positions[i]),
                                   positions[i].logprobs[0])
            stop = state.detokenizer.append(token)
            if not grammar_ok or (ended_at_last and i == len(new) - 1):
                break
            if stop is not None:
                self._end_early(request, stop)
                break
            if state.grammar is not None and state.grammar.is_terminated:
                self._end_early(request, None)  # the constraint is complete
                break
        if state.num_processed_tokens < request.num_output_tokens:
            request.truncate_output(state.num_processed_tokens)
        if request.status.finished:
            if stop is None:
                state.detokenizer.flush()
            del self.states[request.request_id]
            if self.speculator is not None:
                self.speculator.remove(request.request_id)
        return state.output()

    def _end_early(self, request: Request, stop_reason: str | None) -> None:
        """Stop a request at the token just processed (a stop string, a complete grammar),
        even if the scheduler ended it at a later one of this step's tokens."""
        request.stop_reason = stop_reason
        if request.status.finished:  # already freed: only the reason changes
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _advance_grammar(self, state: RequestState, token: int) -> bool:
        """Feed a new token to the request's matcher; False if it refused the token and
        the request was ended (a complete grammar ends the request in `_process`, after
        stop strings have had their say)."""
        request = state.request
        if state.grammar.accept_token(token):
            return True
        # the mask allowed only valid tokens, so this is a backend fault: end the request
        # rather than return text that breaks the constraint
        logger.error("request %s: grammar rejected token %d (%s); finishing it",
                     request.request_id, token, getattr(state.grammar, "error", None))
        if not request.status.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        return False

    # ---- speculative decoding ----------------------------------------------------------

    def _build_speculator(self, config: SpeculativeConfig | None) -> Speculator | None:
        if config is None:
            return None
        draft = None
        if config.method != "ngram":
            draft = DraftModelProposer.build(config, self.config, self.loaded, self.device,
                                             self.kv_plan.num_tokens)
        costs = None
        if config.adaptive:
            if self.executor is not None:
                self.executor.calibrate(config.num_speculative_tokens)
            costs = measure_step_costs(self.loaded.model, self.runner.kv_cache, self.attention,
                                       config.num_speculative_tokens,
                                       draft.time_step if draft is not None else None)
            logger.info("speculative decoding: a draft token costs %s of a step (by batch "
                        "size)", {b: round(c, 2) for b, c in costs.by_batch.items()})
        return Speculator.build(config, draft, costs)

    def _propose_drafts(self) -> None:
        """Drafts for the decoding requests, for the scheduler to send with their last
        token; none when the batch is too large for speculation to pay."""
        running = self.scheduler.running
        if not self.speculator.enabled_for(len(running)):
            return
        requests, rooms = [], []
        for request in running:
            state = self.states.get(request.request_id)
            if state is None or request.num_tokens - request.num_computed_tokens != 1:
                continue  # a beam, or a prompt still prefilling
            if state.grammar is not None and state.grammar.is_terminated:
                continue
            # emitted tokens (drafts + 1) within max_tokens; draft KV within the context
            room = min(request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens)
            requests.append(request)
            rooms.append(room)
        if not requests:
            return
        proposed = self.speculator.propose(requests, rooms, len(running))
        for request, drafts in zip(requests, proposed, strict=True):
            grammar = self.states[request.request_id].grammar
            if drafts and grammar is not None:  # drafts the grammar refuses would be rejected
                drafts = drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    # ---- helpers -----------------------------------------------------------------------

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestRejected("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.loaded.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        return None, ids

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.loaded.config.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejected(f"{name}: token id {bad[0]} is out of range [0, {vocab})")

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as it appears mid-text)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _record_prompt_logprobs(self, runner_out: RunnerOutput) -> None:
        for request_id, (first, positions) in runner_out.prompt_logprobs.items():
            state = self.states.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            state.set_prompt_logprobs(first, [self.logprobs_decoder.entries(p) for p in positions])

    def _check_length(self, num_prompt: int, params: SamplingParams) -> int:
        if num_prompt == 0:
            raise RequestRejected("the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {num_prompt} tokens; the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        room = self.max_model_len - num_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"max_tokens ({max_tokens}) + prompt ({num_prompt} tokens) exceeds the "
                f"model's context of {self.max_model_len} tokens; lower max_tokens to {room}"
            )
        if num_prompt + max_tokens > self.kv_plan.num_tokens:
            raise RequestRejected(
                f"prompt ({num_prompt}) + max_tokens ({max_tokens}) exceeds the whole KV cache "
                f"({self.kv_plan.num_tokens} tokens); raise --kv-cache-memory"
            )
        return max_tokens

    def _start_ranks(self, config: EngineConfig, loaded: LoadedModel | None
                     ) -> Executor | None:
        """Under tensor parallelism: start (or meet) the other ranks and tell them what to
        load; they load their shares while this rank loads its own."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        if loaded is not None:
            raise ValueError("tensor_parallel_size > 1 loads its own shards; it cannot take "
                             "an already loaded model")
        # ranks share the machine's cores unless told otherwise
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // size)
        if config.num_threads is None:
            set_num_threads(threads)
        executor = make_executor(config.distributed_executor_backend, size, self.device,
                                 threads)
        executor.start_workers(WorkerSpec(config.model, self.dtype, str(self.device),
                                          config.weight_quantization, threads, config.seed))
        logger.info("tensor parallel: %d ranks, %d threads each", size, threads)
        return executor

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run steps any more (a tensor-parallel rank died, the KV
        transfer peer went away), or None."""
        if self.executor is not None and self.executor.failure is not None:
            return self.executor.failure
        stats = self.kv_transfer_stats
        return stats.failure if stats is not None else None

    def shutdown(self) -> None:
        """Stop the other ranks (tensor parallelism); a no-op for a single-process engine."""
        if self.executor is not None:
            self.executor.shutdown()

    def _attention_backend_name(self, config: EngineConfig) -> str:
        """config's backend; "auto" on the CPU with the native kernels is chosen by timing
        (`kernel_choice.choose_attention`) where the KV dtype leaves a choice."""
        name = config.attention_backend
        if name != "auto" or self.device.type != "cpu" or native() is None:
            return name
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype,
                                          self.loaded.quantization, native_attention=True)
        if kv_dtype == torch.int8:  # only the native kernel reads int8 entries
            return "native"
        choice = choose_attention(self.loaded.config, kv_dtype)
        logger.info("%s", choice.describe())
        return choice.backend

    def _kv_budget(self) -> int:
        budget = self.config.kv_cache_memory
        if isinstance(budget, float):
            return int(budget * free_memory_bytes(self.device))
        return parse_size(budget)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LLMServeError("device cuda was asked for but no CUDA GPU is available; use cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    from llmserve.config.engine import DTYPES

    name = DTYPES[dtype]
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _TORCH_DTYPES[name]


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold (quantized weights as stored)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = memory_bytes()[1]
    if available is None:
        raise LLMServeError(
            "this system does not say how much memory is free (no /proc/meminfo, psutil not "
            "installed): give --kv-cache-memory (kv_cache_memory) as a size such as 4GiB "
            "rather than a fraction, or pip install psutil")
    return available
