"""How a vision-language model's prompts take images: where each image's tokens go, and
the images' preprocessing on the way.

An image is one run of `VisionConfig.image_token_id`, `tokens_per_image` long, in the
prompt's token ids; the model runner replaces those positions' embeddings with the
image's rows. In text (a prompt string, a rendered chat) an image is its `marker`: the
image token's own text where the vocabulary has one ("<image>"), else "<__media__>" (a
GGUF model with an `--mmproj` projector file, as llama.cpp marks media). Gemma 3 marks an
image with its begin token ("<start_of_image>"), which becomes, as its processor writes
it, a blank line, the begin token, the image's tokens, the end token and a blank line.
"""

from dataclasses import dataclass
from typing import Any

from llmserve.chat_template import ChatTemplateError
from llmserve.config.vision import VisionConfig
from llmserve.errors import RequestRejected
from llmserve.multimodal import ImageInput, ImageProcessor, take_images
from llmserve.tokenizer import Tokenizer

MEDIA_MARKER = "<__media__>"


@dataclass(frozen=True)
class ImagePrompts:
    vision: VisionConfig
    processor: ImageProcessor
    marker: str  # an image in prompt text
    # the image token is the vocabulary's own (a Hugging Face vision-language checkpoint):
    # runs of it in token-id prompts are images; else the id only fills their positions
    token_in_vocabulary: bool

    @classmethod
    def build(cls, vision: VisionConfig, processor: ImageProcessor,
              tokenizer: Tokenizer) -> "ImagePrompts":
        if not vision.image_token_in_vocabulary:
            return cls(vision, processor, MEDIA_MARKER, False)
        marker = vision.begin_image_token_id if vision.pooled else vision.image_token_id
        text = tokenizer.decode([marker], skip_special_tokens=False)
        return cls(vision, processor, text, True)

    def render_chat(self, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                    **template: Any) -> tuple[str, list[ImageInput]]:
        """The chat's prompt text with one marker per image part, and the images
        preprocessed (decoding and preprocessing happen here: call it where prompts are
        tokenized, off the engine's thread). Templates made for images iterate over content
        parts (an image part writes the image token); with one that writes no marker, or
        cannot take parts, each message's markers are written before its text."""
        parts, images = take_images(messages)
        try:
            text = tokenizer.apply_chat_template(parts, **template)
        except ChatTemplateError:
            text = None
        if text is None or text.count(self.marker) != len(images):
            text = tokenizer.apply_chat_template(
                [_flattened(m, self.marker) for m in parts], **template)
            if text.count(self.marker) != len(images):
                raise RequestRejected("the chat template does not place the images")
        return text, [self.processor.image_input(image) for image in images]

    def encode(self, tokenizer: Tokenizer, text: str, images: list,
               add_special_tokens: bool = False) -> tuple[list[int], list[ImageInput]]:
        """Text with one marker per image -> its token ids, each marker an image's run of
        image tokens, and the images placed on them. The text between markers is tokenized
        piece by piece, as the image token (an added token) splits it in the vocabulary."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise RequestRejected(f"the prompt has {len(pieces) - 1} image placeholder(s) "
                                  f"for {len(images)} image(s)")
        vision, size = self.vision, self.vision.tokens_per_image
        if vision.pooled:  # Gemma 3: "\n\n<start_of_image>" image "<end_of_image>\n\n"
            last = len(pieces) - 1
            pieces = [("\n\n" if k else "") + piece + ("\n\n" if k < last else "")
                      for k, piece in enumerate(pieces)]
        ids = tokenizer.encode(pieces[0], add_special_tokens=add_special_tokens)
        placed = []
        for piece, image in zip(pieces[1:], images, strict=True):
            if vision.pooled:
                ids.append(vision.begin_image_token_id)
            placed.append(self._input(image).placed(len(ids), size))
            ids += [vision.image_token_id] * size
            if vision.pooled:
                ids.append(vision.end_image_token_id)
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        return ids, placed

    def place(self, ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """A token-id prompt and its images: images already placed (`encode`'s) are checked
        against the ids; otherwise each run of the image token (written once, expanded
        here, or `tokens_per_image` times) is the next image."""
        size = self.vision.tokens_per_image
        if images and all(isinstance(m, ImageInput) and m.length for m in images):
            return self._check_placed(ids, images)
        if not self.token_in_vocabulary:
            raise RequestRejected(f"this model's images go in text prompts (as "
                                  f"{self.marker}) or chats, not in token ids")
        token = self.vision.image_token_id
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
            if length != size and (length != 1 or self.vision.pooled):
                raise RequestRejected(
                    f"an image takes {size} image tokens in the prompt"
                    f"{'' if self.vision.pooled else ' (or one, expanded here)'}; a run has "
                    f"{length}")
            out += ids[last:start]
            placed.append(self._input(image).placed(len(out), size))
            out += [token] * size
            last = start + length
        return out + ids[last:], placed

    def _check_placed(self, ids: list[int], images: list[ImageInput]
                      ) -> tuple[list[int], list[ImageInput]]:
        token, size, end = self.vision.image_token_id, self.vision.tokens_per_image, 0
        for image in images:
            span = ids[image.offset:image.offset + image.length]
            if image.offset < end or image.length != size or span != [token] * size:
                raise RequestRejected("an image's place does not hold its image tokens")
            end = image.offset + image.length
        if self.token_in_vocabulary and ids.count(token) != size * len(images):
            raise RequestRejected("the prompt holds image tokens that no image fills (an "
                                  "earlier answer's context with its images?)")
        return ids, images

    def _input(self, image: Any) -> ImageInput:
        """A `PIL.Image` preprocessed; an `ImageInput` as it is."""
        return image if isinstance(image, ImageInput) else self.processor.image_input(image)


def _flattened(message: dict[str, Any], marker: str) -> dict[str, Any]:
    """A message of parts as one string: its images' markers, then its text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    images = sum(1 for p in content if p.get("type") == "image")
    text = "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return {**message, "content": f"{marker}\n" * images + text}
