"""The engine: admit requests, then step: schedule -> execute -> update -> outputs.

    add_request():  input processor (tokenize, validate) -> Request(s) -> scheduler.waiting
    step():         scheduler.schedule()          -> SchedulerOutput   (plain data)
                    executor.execute_model(out)   -> ModelRunnerOutput (row per request)
                    scheduler.update(out, result) -> what each request got
                    output_processor.process(...) -> RequestOutputs (detokenized, stops)

Features attach at interfaces, never in `step`: speculative decoding and structured output
are `StepStage`s the scheduler calls (their draft counts, drafts and grammar masks travel
in the `SchedulerOutput`; the drafts themselves are the runner's proposer's, made after
each step's sampling), disaggregated prefill is a `KVConnector` the runner calls, beam search
and n > 1 are parents above the engine's requests (`BeamSearch`, `ParallelGroup`), and
tensor parallelism is the executor's business.
"""

import collections
import itertools
import logging

import torch

from llmserve.config.engine import EngineConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.preemption import ResumeCost
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.distributed.kv_transfer import TransferredKV, TransferStats
from llmserve.engine.beam_search import BeamSearch
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.input_processor import InputProcessor, NewRequest, RequestRejected
from llmserve.engine.kv_connector import KVConnector, make_kv_connector
from llmserve.engine.loading import (
    attention_backend_name,
    build_kv_tier,
    build_pooler,
    build_proposer,
    build_speculator,
    free_memory_bytes,
    image_prompts,
    kv_budget,
    model_bytes,
    resolve_device,
    resolve_dtype,
    speculative_kv_layers,
    start_ranks,
)
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.parallel_sampling import ParallelGroup
from llmserve.engine.request_state import RequestState
from llmserve.executor.abstract import Executor, UniProcExecutor
from llmserve.executor.ranks import CacheSpec
from llmserve.kernels import set_num_threads
from llmserve.layers.attention.selector import attention_backend
from llmserve.layers.kv_cache import KVCache, resolve_kv_cache_dtype
from llmserve.loader import weight_cache
from llmserve.loader.model_loader import LoadedModel, load_model
from llmserve.lora.adapter import LoRAError
from llmserve.lora.manager import LoRAManager
from llmserve.lora_request import LoRARequest
from llmserve.memory import plan_kv_cache
from llmserve.models.compile import warm_up
from llmserve.outputs import PoolingRequestOutput, RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.spec_decode.proposer_stage import ProposerStage
from llmserve.structured import GrammarStage, StructuredOutputManager
from llmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["Engine", "RequestRejected", "free_memory_bytes", "model_bytes",
           "resolve_device", "resolve_dtype"]


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        ranks, quantization = start_ranks(config, loaded, self.device, self.dtype)
        if config.num_threads is not None:
            set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(
            config.model, self.dtype, self.device, quantization,
            # adapters change which ops a step runs: no compiled step under them
            config.enforce_eager or config.enable_lora, tp=ranks.tp if ranks else None,
            mmproj=config.mmproj, stage=ranks.stage if ranks else None,
        )
        self.tokenizer = self.loaded.tokenizer
        model_cfg = self.loaded.config
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        self.attention_backend_name = attention_backend_name(config, self.device, self.dtype,
                                                             self.loaded)
        self.attention = attention_backend(self.device, self.attention_backend_name)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.loaded.quantization,
            self.attention.reads_only_written_slots)
        # under tensor parallelism each rank holds the KV heads of its share (rank 0 the
        # most), and as many blocks as rank 0
        shard = getattr(self.loaded.model, "plan", None)
        num_kv_heads = len(shard.attention.kv_heads) if shard else model_cfg.num_key_value_heads
        # an EAGLE head's, after the target's
        spec_layers = speculative_kv_layers(config, self.loaded)
        # a pipeline stage holds its layers' KV: every stage as many blocks as the one with
        # the most layers can hold
        layers = self.loaded.model.held_layers if ranks else range(model_cfg.num_hidden_layers)
        split = ranks.stage_split if ranks else ()
        plan = plan_kv_cache(model_cfg, self.kv_cache_dtype, kv_budget(config, self.device),
                             config.block_size, num_kv_heads, spec_layers,
                             max(map(len, split), default=None))
        logger.info(
            "KV cache: %d blocks = %d tokens (%.2f GiB, %s); weights: %s, %.0f MiB; "
            "%d threads", plan.num_blocks, plan.num_tokens, plan.total_bytes / 2**30,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.loaded.quantization or str(self.dtype).removeprefix("torch."),
            model_bytes(self.loaded.model) / 2**20, torch.get_num_threads(),
        )
        self.kv_plan = plan
        kv_cache = KVCache.allocate(
            len(layers) + spec_layers, plan.num_blocks, plan.block_size,
            num_kv_heads, model_cfg.head_dim, self.kv_cache_dtype, self.device,
            zeroed=not self.attention.reads_only_written_slots, first_layer=layers.start,
        )
        if ranks is not None:
            ranks.allocate_caches(CacheSpec(
                plan.num_blocks, plan.block_size, self.kv_cache_dtype,
                self.attention_backend_name, config.max_num_seqs))
        self.kv_connector: KVConnector | None = make_kv_connector(
            config.kv_role, config.kv_transfer_address)
        self.kv_tier = build_kv_tier(config, self.loaded, self.dtype, self.kv_cache_dtype,
                                     plan.block_size, num_kv_heads,
                                     self.attention_backend_name, self.device)
        self.pooler = build_pooler(config, self.loaded)
        self.lora = LoRAManager(self.loaded.model, config.max_loras, config.max_lora_rank,
                                config.max_cpu_loras or 16) if config.enable_lora else None
        proposer = build_proposer(config, self.loaded, self.device, self.dtype, kv_cache,
                                  self.attention)
        runner = ModelRunner(self.loaded.model, kv_cache, self.device,
                             max_num_seqs=config.max_num_seqs, attention=self.attention,
                             kv_connector=self.kv_connector, pooler=self.pooler,
                             lora=self.lora, kv_tier=self.kv_tier, proposer=proposer)
        self.executor: Executor = ranks.bind_runner(runner) if ranks else UniProcExecutor(runner)
        warm_up(self.loaded.model, kv_cache, self.attention)
        self.structured = StructuredOutputManager(self.tokenizer, model_cfg.vocab_size)
        self.speculator = build_speculator(config, self.loaded, proposer, self.executor)
        stages = [GrammarStage(self.structured)]
        if self.speculator is not None:
            stages.insert(0, ProposerStage(self.speculator, self.max_model_len))
        self.kv_manager = KVCacheManager(plan.num_blocks, plan.block_size,
                                         config.enable_prefix_caching, self.kv_tier,
                                         drop_last_hit_block=spec_layers > 0)
        resume_cost = ResumeCost(
            config.preemption_mode if self.kv_tier is not None else "recompute",
            plan.block_size, self.kv_tier.layout.block_bytes if self.kv_tier else 0)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
                max_loras=config.max_loras if config.enable_lora else 0,
                whole_images=model_cfg.vision is not None
                and model_cfg.vision.images_attend_both_ways,
                num_lookahead_tokens=config.speculative_config.num_speculative_tokens
                if spec_layers else 0,
            ),
            self.kv_manager, stages, resume_cost,
        )
        self.input_processor = InputProcessor(
            self.tokenizer, model_cfg.vocab_size, self.max_model_len, plan.num_tokens,
            self.structured, config.kv_role, image_prompts(self.loaded))
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self._ids = itertools.count()
        # steps begun and not yet finished (a pipeline keeps one per stage in flight)
        self._in_flight: collections.deque = collections.deque()
        weight_cache.write_queued()  # the timings are done: keep the loaded weights now

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: "str | TransferredKV | None" = None,
        lora_request: LoRARequest | None = None,
        grammars: list | None = None,
    ) -> str:
        """Queue a prompt (text, token ids, or {"prompt_token_ids": [...]}); returns its id.

        `lora_request`: the LoRA adapter to run it with (`enable_lora`); loaded and checked
        against the model now, so an adapter that does not fit is refused before it queues.

        `n > 1` or `best_of` fan out into sibling requests sharing the prompt's blocks;
        `use_beam_search` runs a beam search above them. Either way the caller sees one id.
        `kv_transfer` (disaggregated prefill/decode): on a prefill engine, the transfer id
        the prompt's KV is sent under; on a decode engine, the `TransferredKV` header
        (`KVConnector.wait_for`) it continues from.
        `PoolingParams` (the pooling runner): one prefill of the prompt, whose output is a
        `PoolingRequestOutput` (an embedding, or class scores).
        `grammars`: the structured-output matchers of its sequences, made ready off this
        thread (`StructuredOutputManager.prepare`); None: compiled here.
        """
        if isinstance(params, PoolingParams) or self.pooler is not None:
            return self._add_pooling(prompt, params, request_id, priority, arrival_time,
                                     cache_salt)
        params = params or SamplingParams()
        self._check_lora(lora_request)
        new = self.input_processor.process(prompt, params, priority, arrival_time,
                                           cache_salt, kv_transfer, grammars)
        new.lora_request = lora_request
        request_id = request_id or f"req-{next(self._ids)}"
        if self.output_processor.in_use(request_id):
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if params.use_beam_search:
            stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
            search = BeamSearch(request_id, params, stop_ids, new.max_tokens, new.text,
                                new.ids, new.arrival_time, self._add_beam,
                                self.tokenizer.decode, new.priority, new.cache_salt)
            search.lora_request = lora_request
            self.output_processor.parents[request_id] = search
            search.start()
        elif params.n > 1 or (params.best_of or 1) > params.n:
            group = ParallelGroup(request_id, params)
            self.output_processor.parents[request_id] = group
            for i in range(group.best_of):
                self._add_one(group.child_id(i), new, group.child_params(i), group, i)
        else:
            self._add_one(request_id, new, params, kv_transfer=kv_transfer)
        return request_id

    def _add_one(
        self, request_id: str, new: NewRequest, params: SamplingParams,
        parent: ParallelGroup | BeamSearch | None = None, index: int = 0,
        kv_transfer: "str | TransferredKV | None" = None,
    ) -> None:
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        request = Request(
            request_id, new.ids, params, new.max_tokens, stop_ids, new.priority,
            new.cache_salt, share_group=parent.request_id if parent else None,
            arrival_time=new.arrival_time, lora_request=new.lora_request,
        )
        request.bad_words_token_ids = new.bad_words_token_ids
        request.mm_inputs = new.images
        if isinstance(kv_transfer, str):
            request.remote_decode = kv_transfer
        elif kv_transfer is not None:
            request.remote_kv = kv_transfer
        if params.structured_outputs is not None:
            request.grammar = new.grammars.pop() if new.grammars else \
                self.structured.matcher(params.structured_outputs)
        detok = IncrementalDetokenizer(
            self.tokenizer, new.ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output, params.detokenize,
        )
        self.output_processor.add(RequestState(request, new.text, detok, parent, index))
        self.scheduler.add_request(request)

    def _add_pooling(self, prompt: str | list[int] | dict, pooling: PoolingParams | None,
                     request_id: str | None, priority: int, arrival_time: float | None,
                     cache_salt: str | None) -> str:
        """A pooling request: its prompt prefilled through the same scheduler (batched,
        chunked, prefix-cached when its pooling allows), one sampled-nothing step at its end."""
        if self.pooler is None:
            raise RequestRejected("embedding and classification requests need the pooling "
                                  "runner (--runner pooling)")
        if not isinstance(pooling, PoolingParams):
            raise RequestRejected("this engine runs the pooling runner: it embeds and "
                                  "classifies, it does not generate")
        if pooling.task == "classify" and self.pooler.num_labels is None:
            raise RequestRejected("this model has no classifier (serve it with --convert "
                                  "classify: a score head, or classifier_from_token)")
        # one "token" of room: the runner pools where a generation would sample
        params = SamplingParams(max_tokens=1, temperature=0, detokenize=False,
                                truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        new = self.input_processor.process(prompt, params, priority, arrival_time,
                                           cache_salt, None)
        request_id = request_id or f"req-{next(self._ids)}"
        if self.output_processor.in_use(request_id):
            raise RequestRejected(f"request id {request_id!r} is already in use")
        request = Request(request_id, new.ids, params, 1, frozenset(), new.priority,
                          new.cache_salt, arrival_time=new.arrival_time)
        request.pooling_params = pooling
        request.mm_inputs = new.images
        request.pools_every_position = self.pooler.config.needs_every_position
        detok = IncrementalDetokenizer(self.tokenizer, new.ids, True, [], False, False)
        self.output_processor.add(RequestState(request, new.text, detok))
        self.scheduler.add_request(request)
        return request_id

    def _add_beam(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  search: BeamSearch) -> None:
        new = NewRequest(search.prompt, token_ids, 1, search.priority, search.arrival_time,
                         search.cache_salt, [], getattr(search, "lora_request", None))
        self._add_one(request_id, new, params, search)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if self.lora is None:
            raise RequestRejected(f"LoRA adapter {lora_request.lora_name!r} requested, but "
                                  f"this engine runs without adapters (enable_lora)")
        # the adapters queued and running requests need stay loaded
        in_use = {r.lora_request.lora_int_id for r in [*self.scheduler.running,
                                                       *self.scheduler.waiting]
                  if r.lora_request is not None}
        try:
            self.lora.get(lora_request, in_use)
        except LoRAError as e:
            raise RequestRejected(str(e)) from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its KV blocks; returns its final output."""
        for engine_id in self.output_processor.engine_ids(request_id):
            request = self.scheduler.finish_request(engine_id, RequestStatus.FINISHED_ABORTED)
            if request is not None and request.remote_kv is not None:
                self.kv_connector.release(request.remote_kv.transfer_id)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One scheduling + forward step; the outputs (per `output_kind`) of every request
        that got tokens, one per caller's request id."""
        if self.executor.pipeline_depth > 1:
            return self._pipelined_step()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        updates = self.scheduler.update(scheduler_output, runner_output)
        return self.output_processor.process(updates)

    def _pipelined_step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Pipeline parallelism: begin steps until one per stage is in flight (each
        schedules requests none of the others holds: a decode waits for its token), then
        finish the oldest. Under load every stage is busy with its own step; with
        nothing to schedule the loop stops early, and a lone request runs step by step."""
        while len(self._in_flight) < self.executor.pipeline_depth:
            out = self.scheduler.schedule()
            self._in_flight.append((out, self.executor.begin(out)))
            self.scheduler.begun(out)
            if not out.scheduled:
                break
        out, begun = self._in_flight.popleft()
        try:
            runner_output = self.executor.finish(begun)
        finally:
            self.scheduler.finished(out)
        updates = self.scheduler.update(out, runner_output)
        return self.output_processor.process(updates)

    # ---- state -------------------------------------------------------------------------

    @property
    def step_request_ids(self) -> list[str]:
        """The engine request ids of the latest step (whose failure fails them)."""
        return self.scheduler.last_scheduled_ids

    def callers_of(self, request_ids: list[str]) -> set[str]:
        """The callers' request ids behind engine request ids."""
        return {self.output_processor.caller_of(r) for r in request_ids}

    @property
    def num_prefill_computed_tokens(self) -> int:
        """Prompt tokens this engine computed (not prefix-cache hits, not transferred KV)."""
        return self.scheduler.num_prefill_computed_tokens

    @property
    def kv_transfer_stats(self) -> TransferStats | None:
        return self.kv_connector.stats if self.kv_connector is not None else None

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run steps any more (a tensor-parallel rank died, the KV
        transfer peer went away), or None."""
        if self.executor.failure is not None:
            return self.executor.failure
        stats = self.kv_transfer_stats
        return stats.failure if stats is not None else None

    def shutdown(self) -> None:
        """Stop the other ranks (tensor parallelism); write out the KV tier's last blocks."""
        self.executor.shutdown()
        if self.kv_tier is not None:
            self.kv_tier.close()
