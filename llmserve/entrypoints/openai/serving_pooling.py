"""The pooling runner's routes (`llmserve serve --runner pooling`), in vLLM's shapes:

    /v1/embeddings            OpenAI's: strings or token ids, float or base64, dimensions
    /classify                 class probabilities per input, with their labels
    /v1/score, /score         scores of text_1 x text_2 pairs (`llmserve/scoring.py`)
    /rerank, /v1/rerank, /v2/rerank   Jina's / Cohere's: documents ranked for a query

Every input is one engine request (a prefill, nothing sampled), all admitted at once so the
scheduler batches them; a refused one aborts the others (as completions do).
"""

import asyncio
import base64
import struct
from typing import Any, ClassVar, Literal

from pydantic import Field

from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.input_processor import RequestRejected
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    OpenAIModel,
    Refusals,
    now,
    refuse_set_fields,
)
from llmserve.entrypoints.openai.serving_base import OpenAIServing
from llmserve.outputs import PoolingRequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.scoring import classifier_score, cosine, cross_encoder_prompt, pair_up
from llmserve.tokenizer import PromptTooLong

MAX_INPUTS = 2048  # inputs (texts, token lists, documents) in one request
# vLLM's pooling request fields that would change the answer and are not served here:
# a 400 naming them, never dropped (fields no API defines are logged and ignored)
_REFUSED: Refusals = {
    "embed_dtype": (("float32",), "embeddings are float32"),
    "endianness": (("native", "little"), "base64 embeddings are little-endian float32"),
    "mm_processor_kwargs": (({},), "this server serves text-only models"),
    "softmax": ((True,), "use use_activation"),
    "activation": ((True,), "use use_activation"),
    "chat_template": ((), "a chat template per request is not accepted"),
    "messages": ((), "pooling inputs are texts or token ids, not chat messages"),
}


class PoolingRequest(OpenAIModel):
    """Fields every pooling route shares (vLLM's)."""

    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = 0
    cache_salt: str | None = None  # as on the generation routes: its own prefix-cache blocks
    user: str | None = None  # OpenAI's end-user id: changes nothing


class EmbeddingRequest(PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    add_special_tokens: bool = True


class ClassificationRequest(PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    use_activation: bool = True  # False: the raw logits
    add_special_tokens: bool = True


class ScoreRequest(PoolingRequest):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(PoolingRequest):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True


class OpenAIServingPooling(OpenAIServing):
    """Embeddings, classes, scores and rankings from one pooling engine."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        super().__init__(engine, model_name)
        self.pooler = engine.engine.pooler
        self.convert = engine.engine.config.convert or "embed"
        self.labels: dict[str, str] = engine.engine.loaded.config.extra.get("id2label") or {}

    def _check(self, body: PoolingRequest, task: str) -> None:
        self.check_model(body.model)
        refuse_set_fields(body.model_extra or {}, _REFUSED)
        if self.pooler is None:
            raise BadRequest("this server generates text; embeddings, classification and "
                             "scores need a server started with --runner pooling",
                             param="model")
        if task == "classify" and self.pooler.num_labels is None:
            raise BadRequest("this server's model has no classifier (start it with "
                             "--convert classify)", param="model")

    async def embeddings(self, body: EmbeddingRequest, arrival_time: float) -> dict[str, Any]:
        self._check(body, "embed")
        params = _params("embed", body.truncate_prompt_tokens, dimensions=body.dimensions,
                         normalize=body.normalize)
        outputs = await self._run(await self._inputs(body), params, "input", body,
                                  arrival_time)
        data = []
        for i, output in enumerate(outputs):
            vector = output.outputs.data
            if body.dimensions is not None and body.dimensions > vector.numel():
                raise BadRequest(f"dimensions ({body.dimensions}) is more than the model's "
                                 f"{vector.numel()}", param="dimensions")
            embedding: Any = vector.tolist()
            if body.encoding_format == "base64":  # little-endian float32, as OpenAI's
                embedding = base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)
                                             ).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return {"id": _id("embd"), "object": "list", "created": now(),
                "model": self.model_name, "data": data, "usage": _usage(outputs)}

    async def classify(self, body: ClassificationRequest, arrival_time: float
                       ) -> dict[str, Any]:
        self._check(body, "classify")
        params = _params("classify", body.truncate_prompt_tokens,
                         use_activation=body.use_activation)
        outputs = await self._run(await self._inputs(body), params, "input", body,
                                  arrival_time)
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": self.labels.get(str(best), str(best)),
                         "probs": probs, "num_classes": len(probs)})
        return {"id": _id("classify"), "object": "list", "created": now(),
                "model": self.model_name, "data": data, "usage": _usage(outputs)}

    async def score(self, body: ScoreRequest, arrival_time: float) -> dict[str, Any]:
        self._check(body, "score")
        try:
            pairs = pair_up(body.text_1, body.text_2)
        except ValueError as e:
            raise BadRequest(str(e), param="text_2") from None
        scores, outputs = await self._scores(pairs, "text_2", body, arrival_time)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": _id("score"), "object": "list", "created": now(),
                "model": self.model_name, "data": data, "usage": _usage(outputs)}

    async def rerank(self, body: RerankRequest, arrival_time: float) -> dict[str, Any]:
        self._check(body, "score")
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        if not texts:
            raise BadRequest("documents is empty", param="documents")
        if len(texts) > MAX_INPUTS:
            raise BadRequest(f"at most {MAX_INPUTS} documents a request", param="documents")
        scores, outputs = await self._scores([(body.query, t) for t in texts], "documents",
                                             body, arrival_time)
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i])
        if body.top_n is not None:
            ranked = ranked[: body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if body.return_documents else {})}
                   for i in ranked]
        return {"id": _id("rerank"), "model": self.model_name, "results": results,
                "usage": {"total_tokens": _usage(outputs)["total_tokens"]}}

    async def _scores(self, pairs: list[tuple[str, str]], field: str, body: PoolingRequest,
                      arrival_time: float) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Each pair's score: a cross-encoder's (convert classify) or the cosine of the
        two texts' embeddings (each distinct text embedded once)."""
        if self.convert == "classify":
            prompts = await self.engine.run_blocking(
                lambda: [cross_encoder_prompt(self.tokenizer, a, b) for a, b in pairs])
            outputs = await self._run(prompts, _params("classify", body.truncate_prompt_tokens),
                                      field, body, arrival_time)
            try:
                return [classifier_score(o.outputs.data) for o in outputs], outputs
            except ValueError as e:
                raise BadRequest(str(e), param="model") from None
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outputs = await self._run(texts, _params("embed", body.truncate_prompt_tokens), field,
                                  body, arrival_time)
        vectors = {t: o.outputs.data for t, o in zip(texts, outputs, strict=True)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], outputs

    async def _inputs(self, body: EmbeddingRequest | ClassificationRequest) -> list[Any]:
        """The request's inputs as engine prompts (strings without special tokens
        tokenized here; `_run` tokenizes the others)."""
        prompts = _inputs(body.input, "input")
        if body.add_special_tokens:
            return prompts
        return await self.engine.run_blocking(lambda: [
            {"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)}
            if isinstance(p, str) else p for p in prompts])

    def _tokenized(self, prompts: list[Any], field: str, limit: int | None) -> list[Any]:
        """Text prompts as token ids (with the tokenizer's special tokens, as the engine
        adds them), a text certainly longer than `limit` tokens refused as soon as that
        is known."""
        tokenized = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                try:
                    prompt = {"prompt_token_ids": self.tokenizer.encode(prompt, limit=limit)}
                except PromptTooLong as e:
                    raise BadRequest(f"{field}[{i}]: {e}", param=field) from None
            tokenized.append(prompt)
        return tokenized

    async def _run(self, prompts: list[Any], params: PoolingParams, field: str,
                   body: PoolingRequest, arrival_time: float) -> list[PoolingRequestOutput]:
        """Admit every input, then wait for all; a refused one aborts the others."""
        if len(prompts) > MAX_INPUTS:
            raise BadRequest(f"at most {MAX_INPUTS} inputs a request", param=field)
        if any(isinstance(p, str) for p in prompts):  # tokenized here, not by the engine
            limit = None if body.truncate_prompt_tokens is not None else \
                self.engine.max_model_len
            prompts = await self.engine.run_blocking(self._tokenized, prompts, field, limit)
        request_id = _id("pool")
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(
                    prompt, params, f"{request_id}-{i}", arrival_time, body.priority,
                    body.cache_salt))
        except RequestRejected as e:
            for stream in streams:
                stream.abort()
            message = str(e)
            param = "truncate_prompt_tokens" if "truncate_prompt_tokens" in message else field
            raise BadRequest(f"{field}[{len(streams)}]: {message}", param=param) from None
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        try:
            return list(await asyncio.gather(*(_final(s) for s in streams)))
        finally:
            for stream in streams:
                stream.abort()


async def _final(stream: Any) -> PoolingRequestOutput:
    async for output in stream:
        if isinstance(output, PoolingRequestOutput):
            return output
    raise BadRequest("the request was aborted before its output", status=503)


def _params(task: str, truncate: int | None, **options: Any) -> PoolingParams:
    try:
        return PoolingParams(task, truncate_prompt_tokens=truncate, **options)
    except ValueError as e:
        field = "truncate_prompt_tokens" if "truncate_prompt_tokens" in str(e) else "dimensions"
        raise BadRequest(str(e), param=field) from None


def _inputs(value: Any, field: str) -> list[Any]:
    """A request's inputs as engine prompts: strings, or token id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequest(f"{field} is empty", param=field)
    if isinstance(value[0], int):
        return [{"prompt_token_ids": value}]
    if isinstance(value[0], list):
        return [{"prompt_token_ids": ids} for ids in value]
    return list(value)


def _usage(outputs: list[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _id(prefix: str) -> str:
    import uuid

    return f"{prefix}-{uuid.uuid4().hex}"
