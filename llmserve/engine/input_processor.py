"""From a caller's prompt and parameters to a validated request: tokenize, check, refuse.

Everything a request can be refused for is found here, before it queues: an empty or
too-long prompt, token ids outside the vocabulary, a constraint that does not compile, a
disaggregated-prefill request this engine's role cannot take.
"""

import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.distributed.kv_transfer import TransferredKV
from llmserve.engine.image_prompts import ImagePrompts
from llmserve.errors import RequestRejected
from llmserve.multimodal.images import MAX_IMAGES_PER_REQUEST, ImageInput
from llmserve.sampling_params import SamplingParams
from llmserve.structured import StructuredOutputManager
from llmserve.tokenizer import Tokenizer

__all__ = ["InputProcessor", "NewRequest", "RequestRejected"]

# what a prompt dict may hold (vLLM's TextPrompt / TokensPrompt keys that apply here)
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"})


@dataclass
class NewRequest:
    """A validated prompt waiting to become one or more engine requests."""

    text: str | None
    ids: list[int]
    max_tokens: int
    priority: int
    arrival_time: float
    cache_salt: str | None
    bad_words_token_ids: list[list[int]]
    lora_request: Any = None  # its LoRA adapter (a LoRARequest), set by the engine
    # its sequences' grammar matchers, prepared off the engine thread (the server's grammar
    # pool: `StructuredOutputManager.prepare`); None: compiled as each sequence is added
    grammars: list | None = None
    images: list[ImageInput] = field(default_factory=list)  # placed in `ids`


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 kv_cache_tokens: int, structured: StructuredOutputManager,
                 kv_role: str | None, images: ImagePrompts | None = None) -> None:
        self.images = images  # None: the model reads text only
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.structured = structured
        self.kv_role = kv_role

    def process(self, prompt: str | list[int] | dict, params: SamplingParams, priority: int,
                arrival_time: float | None, cache_salt: str | None,
                kv_transfer: "str | TransferredKV | None",
                grammars: list | None = None) -> NewRequest:
        text, ids = self._tokenize(prompt)
        ids, images = self._place_images(prompt, ids)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise RequestRejected("cache_salt is given twice, with different values")
            cache_salt = prompt["cache_salt"]
        keep = params.truncate_prompt_tokens
        if keep is not None:  # asked for: the prompt's last tokens, the text no longer its own
            keep = self.max_model_len - 1 if keep == -1 else keep
            if len(ids) > keep:
                if images:
                    raise RequestRejected("truncate_prompt_tokens would cut a prompt with "
                                          "images")
                text, ids = None, ids[len(ids) - keep:]
        if kv_transfer is not None:
            self._check_kv_transfer(kv_transfer, ids, params)
        max_tokens = self._check_length(len(ids), params)
        self._check_token_ids(params)
        if params.structured_outputs is not None and grammars is None:
            try:  # compile now (cached): an invalid constraint is refused before it queues
                self.structured.backend.compile(params.structured_outputs)
            except ValueError as e:
                raise RequestRejected(str(e)) from None
        if images and params.use_beam_search:
            raise RequestRejected("beam search does not take images")
        return NewRequest(text, ids, max_tokens, priority, arrival_time or time.time(),
                          cache_salt, self._bad_words_token_ids(params.bad_words or []),
                          grammars=grammars, images=images)

    def _place_images(self, prompt: str | list[int] | dict, ids: list[int]
                      ) -> tuple[list[int], list[ImageInput]]:
        """A dict prompt's `multi_modal_data` images placed on its image tokens."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            if self.images is not None and self.images.token_in_vocabulary and \
                    self.images.vision.image_token_id in ids:
                raise RequestRejected("the prompt holds the image token but no image")
            return ids, []
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise RequestRejected("multi_modal_data takes 'image': an image or a list")
        images = data.get("image", [])
        images = images if isinstance(images, list | tuple) else [images]
        if self.images is None:
            if images:
                raise RequestRejected("this model reads text only: it takes no images")
            return ids, []
        # images placed already come from a chat rendered here, its images counted there
        # (an Idefics3 image is placed as its tiles, many more than the images)
        if sum(not (isinstance(m, ImageInput) and m.length) for m in images) > \
                MAX_IMAGES_PER_REQUEST:
            raise RequestRejected(f"{len(images)} images in one prompt; at most "
                                  f"{MAX_IMAGES_PER_REQUEST}")
        text = prompt.get("prompt")
        if isinstance(text, str) and "prompt_token_ids" not in prompt:
            return self.images.encode(self.tokenizer, text, list(images), True)
        return self.images.place(ids, list(images))

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise RequestRejected(f"a prompt dict takes {', '.join(sorted(PROMPT_KEYS))}; "
                                      f"{unknown[0]!r} is not supported")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestRejected("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is out of range "
                                  f"[0, {self.vocab_size})")
        return None, ids

    def _check_kv_transfer(self, kv_transfer: "str | TransferredKV", ids: list[int],
                           params: SamplingParams) -> None:
        role = self.kv_role
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

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
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
        if num_prompt + max_tokens > self.kv_cache_tokens:
            raise RequestRejected(
                f"prompt ({num_prompt}) + max_tokens ({max_tokens}) exceeds the whole KV cache "
                f"({self.kv_cache_tokens} tokens); raise --kv-cache-memory"
            )
        return max_tokens
