"""From a caller's prompt and parameters to a validated request: tokenize, check, refuse.

Everything a request can be refused for is found here, before it queues: an empty or
too-long prompt, token ids outside the vocabulary, a constraint that does not compile, a
disaggregated-prefill request this engine's role cannot take.
"""

import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.chat_template import ChatTemplateError
from llmserve.config.vision import VisionConfig
from llmserve.distributed.kv_transfer import TransferredKV
from llmserve.errors import LLMServeError
from llmserve.multimodal import (
    MAX_IMAGES_PER_REQUEST,
    ImageInput,
    ImageProcessor,
    take_images,
)
from llmserve.sampling_params import SamplingParams
from llmserve.structured import StructuredOutputManager
from llmserve.tokenizer import Tokenizer


class RequestRejected(LLMServeError, ValueError):
    """A request that can never run (too long for the model or the cache)."""


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


@dataclass(frozen=True)
class ImagePrompts:
    """How a vision-language model's prompts take images: each image is one run of the
    image token in the prompt, written once (expanded here to the image's
    `tokens_per_image` positions) or already that many times."""

    vision: VisionConfig
    processor: ImageProcessor

    def render_chat(self, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                    **template: Any) -> tuple[str, list[ImageInput]]:
        """The chat's prompt text with one image token per image part, and the images
        preprocessed. Templates made for images iterate over content parts (an image part
        writes the image token); with one that writes no image token, or cannot take parts,
        each message's image tokens are written before its text."""
        parts, images = take_images(messages)
        token = tokenizer.decode([self.vision.image_token_id], skip_special_tokens=False)
        try:
            text = tokenizer.apply_chat_template(parts, **template)
        except ChatTemplateError:
            text = None
        if text is None or text.count(token) != len(images):
            text = tokenizer.apply_chat_template(
                [_flattened(m, token) for m in parts], **template)
            if text.count(token) != len(images):
                raise RequestRejected("the chat template does not place the images")
        return text, [self.processor.image_input(image) for image in images]

    def place(self, ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's run expanded, and the images placed on them
        (a `PIL.Image` is preprocessed here; an `ImageInput` was already)."""
        token, size = self.vision.image_token_id, self.vision.tokens_per_image
        runs: list[tuple[int, int]] = []  # (start, length) of each run of the image token
        for i, t in enumerate(ids):
            if t != token:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        if len(runs) != len(images):
            raise RequestRejected(f"the prompt has {len(runs)} image placeholder(s) for "
                                  f"{len(images)} image(s)")
        out: list[int] = []
        placed: list[ImageInput] = []
        last = 0
        for (start, length), image in zip(runs, images, strict=True):
            if length not in (1, size):
                raise RequestRejected(f"an image takes {size} image tokens in the prompt "
                                      f"(or one, expanded here); a run has {length}")
            out += ids[last:start]
            if not isinstance(image, ImageInput):
                image = self.processor.image_input(image)
            placed.append(image.placed(len(out), size))
            out += [token] * size
            last = start + length
        return out + ids[last:], placed


def _flattened(message: dict[str, Any], image_token: str) -> dict[str, Any]:
    """A message of parts as one string: its images' tokens, then its text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    images = sum(1 for p in content if p.get("type") == "image")
    text = "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return {**message, "content": f"{image_token}\n" * images + text}


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
            if self.images is not None and self.images.vision.image_token_id in ids:
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
        if len(images) > MAX_IMAGES_PER_REQUEST:
            raise RequestRejected(f"{len(images)} images in one prompt; at most "
                                  f"{MAX_IMAGES_PER_REQUEST}")
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
