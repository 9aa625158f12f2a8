"""The engine: admit requests, step the scheduler and the model, turn tokens into outputs.

    step():  scheduler.schedule() -> runner.execute() -> scheduler.update() -> detokenize/stop
"""

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler, SchedulerConfig
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.request import Request, RequestStatus
from llmserve.errors import LLMServeError
from llmserve.loader.model_loader import LoadedModel, load_model
from llmserve.memory import parse_size, plan_kv_cache
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.worker.attention import KVCache
from llmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RequestRejected(LLMServeError, ValueError):
    """A request that can never run (too long for the model or the cache)."""


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.loaded = loaded or load_model(config.model, self.dtype, self.device)
        self.tokenizer = self.loaded.tokenizer
        model_cfg = self.loaded.config
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        plan = plan_kv_cache(model_cfg, self.dtype, self._kv_budget(), config.block_size)
        logger.info(
            "KV cache: %d blocks = %d tokens (%.2f GiB)",
            plan.num_blocks, plan.num_tokens, plan.total_bytes / 2**30,
        )
        self.kv_plan = plan
        kv_cache = KVCache.allocate(
            model_cfg.num_hidden_layers, plan.num_blocks, plan.block_size,
            model_cfg.num_key_value_heads, model_cfg.head_dim, self.dtype, self.device,
        )
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
        self.runner = ModelRunner(self.loaded.model, kv_cache, self.device)
        self.tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a prompt (text, token ids, or {"prompt_token_ids": [...]}); returns its id."""
        params = params or SamplingParams()
        if params.n != 1:
            raise RequestRejected("n > 1 is not supported by this engine version; use n=1")
        text, ids = self._tokenize(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.tracked:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        max_tokens = self._check_length(len(ids), params)
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        request = Request(
            request_id, ids, params, max_tokens, stop_ids, priority, cache_salt,
            arrival_time=arrival_time or time.time(),
        )
        detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output,
        )
        self.tracked[request_id] = _Tracked(request, text, detok)
        self.scheduler.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its KV blocks; returns its final output."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self.tracked)

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step; outputs of every request that got a token."""
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        updated = self.scheduler.update(out, sampled)
        outputs = []
        for request in updated:
            tracked = self.tracked[request.request_id]
            stop = tracked.detokenizer.append(request.output_token_ids[-1])
            if stop is not None and not request.status.finished:
                request.stop_reason = stop
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            if request.status.finished:
                if stop is None:
                    tracked.detokenizer.flush()
                del self.tracked[request.request_id]
            outputs.append(self._output(tracked))
        return outputs

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

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        finished = request.status.finished
        t = request.timings
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.visible_text(finished),
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )
        metrics = RequestMetrics(
            t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
            request.num_output_tokens,
        )
        return RequestOutput(
            request.request_id, tracked.prompt, request.prompt_token_ids, [completion],
            finished, metrics, request.num_cached_tokens,
        )

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
    from llmserve.config import DTYPES

    name = DTYPES[dtype]
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _TORCH_DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
