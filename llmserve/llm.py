"""The offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(...)`, vLLM-shaped;
with `runner="pooling"`, `LLM.embed`, `LLM.classify` and `LLM.score`."""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.errors import RequestRejected
from llmserve.lora_request import LoRARequest
from llmserve.multimodal.images import IMAGE_PART_TYPES
from llmserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.scoring import classifier_score, cosine, cross_encoder_prompt, pair_up

Prompt = str | dict[str, Any] | list[int]


class LLM:
    """Run many prompts through one continuously batched engine and return outputs in order.

    `LLM(model=None, dtype="auto", **engine_options)`; options are `EngineConfig` fields
    (block_size, kv_cache_memory, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, scheduling_policy, seed, device, enforce_eager,
    attention_backend, speculative_config, tensor_parallel_size, pipeline_parallel_size,
    pipeline_layer_partition, runner, convert,
    pooler_config, enable_lora, max_loras, max_lora_rank, max_cpu_loras).

    The engine is asked for final outputs only (`RequestOutputKind.FINAL_ONLY`, whatever
    the params say), so a request costs no per-step output work and each full
    `RequestOutput` is built once, when its request finishes.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_options: Any):
        self._attach(Engine(EngineConfig(model=model, dtype=dtype, **engine_options)))

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """Wrap an existing engine (e.g. one sharing an already loaded model)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one per prompt (None: the base
        model); the engine needs `enable_lora=True`."""
        if isinstance(prompts, str | dict) or _is_token_ids(prompts):
            prompts = [prompts]
        params = _final_only(_per_prompt(sampling_params, len(prompts)))
        loras = list(lora_request) if isinstance(lora_request, Sequence) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora_request entries for {len(prompts)} prompts")
        ids = []
        for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras, strict=True)):
            try:
                ids.append(self.engine.add_request(prompt, sp, lora_request=lora))
            except ValueError as e:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                raise type(e)(f"prompt {i}: {e}") from None
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template; on a
        vision-language model a message's content may hold image parts (`{"type":
        "image", "image": <PIL image>}` or OpenAI's `image_url` with a data URL)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        images = self.engine.input_processor.images  # None: a text model
        prompts = []
        for c in conversations:
            if images is None:
                if any(isinstance(m.get("content"), list) and any(
                        isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                        for p in m["content"]) for m in c):
                    raise RequestRejected("this model reads text only: it takes no images")
                prompts.append({"prompt_token_ids": self.tokenizer.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt, tokenize=True)})
                continue
            text, inputs = images.render_chat(self.tokenizer, c,
                                              add_generation_prompt=add_generation_prompt)
            ids, placed = images.encode(self.tokenizer, text, inputs)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": placed}})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """`generate` with beam search (`use_beam_search` set on copies of the params): each
        output holds the n best of `beam_width` hypotheses. The search runs above the
        engine's requests (`engine/beam_search.py`), one step of beams at a time."""
        if isinstance(prompts, str | dict) or _is_token_ids(prompts):
            prompts = [prompts]
        params = [replace(sp, use_beam_search=True)
                  for sp in _per_prompt(sampling_params, len(prompts))]
        return self.generate(prompts, params, use_tqdm)

    # ---- the pooling runner (runner="pooling"): embeddings, classes, scores ------------

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One pooled output per prompt (each prompt prefilled once, batched)."""
        if isinstance(prompts, str | dict) or _is_token_ids(prompts):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling params for {len(prompts)} "
                                 f"prompts; give one or {len(prompts)}")
        ids = []
        for i, (prompt, pp) in enumerate(zip(prompts, params, strict=True)):
            try:
                ids.append(self.engine.add_request(prompt, pp))
            except ValueError as e:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                raise type(e)(f"prompt {i}: {e}") from None
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings (`outputs.embedding`), normalised as the pooler config says."""
        params = replace(pooling_params or PoolingParams(), task="embed")
        return [EmbeddingRequestOutput.from_base(o)
                for o in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities (`outputs.probs`) from the classifier (`convert="classify"`)."""
        params = replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(o)
                for o in self.encode(prompts, params, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Scores of text pairs (`llmserve/scoring.py`): a cross-encoder's for a classifier,
        the embeddings' cosine similarity for an embedding model."""
        pairs = pair_up(text_1, text_2)
        if self.engine.config.convert == "classify":
            prompts = [cross_encoder_prompt(self.tokenizer, a, b) for a, b in pairs]
            outputs = self.encode(prompts, PoolingParams(task="classify"), use_tqdm)
            return [ScoringRequestOutput(o.request_id,
                                         ScoringOutput(classifier_score(o.outputs.data)),
                                         o.prompt_token_ids) for o in outputs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.encode(texts, PoolingParams(task="embed"), use_tqdm),
                            strict=True))
        results = []
        for a, b in pairs:
            first, second = embedded[a], embedded[b]
            results.append(ScoringRequestOutput(
                f"{first.request_id}-{second.request_id}",
                ScoringOutput(cosine(first.outputs.data, second.outputs.data)),
                first.prompt_token_ids + second.prompt_token_ids))
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   unit="req", dynamic_ncols=True)
        num_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if isinstance(output, RequestOutput):
                            num_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"output {num_tokens / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _is_token_ids(prompts: Any) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The params with output_kind FINAL_ONLY (copies; the caller's objects are kept)."""
    copies: dict[int, SamplingParams] = {}
    for sp in params:
        if id(sp) not in copies:
            final = RequestOutputKind.FINAL_ONLY
            copies[id(sp)] = sp if sp.output_kind is final else replace(sp, output_kind=final)
    return [copies[id(sp)] for sp in params]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts; give one or {n}")
    return list(params)
