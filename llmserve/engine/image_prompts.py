"""How a vision-language model's prompts take images: where each image's tokens go, and
the images' preprocessing on the way.

An image is one run of `VisionConfig.image_token_id`, `tokens_per_image` long (Qwen2.5-VL:
one token per 28 x 28 px of the image as its processor resizes it), in the prompt's token
ids; the model runner replaces those positions' embeddings with the
image's rows. In text (a prompt string, a rendered chat) an image is its `marker`: the
image token's own text where the vocabulary has one ("<image>"), else "<__media__>" (a
GGUF model with an `--mmproj` projector file, as llama.cpp marks media). Gemma 3 marks an
image with its begin token ("<start_of_image>"), which becomes, as its processor writes
it, a blank line, the begin token, the image's tokens, the end token and a blank line.
Idefics3 / SmolVLM split an image into tiles (`TiledImage`), each its own run of image
tokens, written as their processor writes them: `<fake_token_around_image><row_1_col_1>`
and the tile's tokens for each tile, a line break after each row, then a blank line and
`<fake_token_around_image><global-img>`, the whole image's tokens and
`<fake_token_around_image>`.
"""

from dataclasses import dataclass
from typing import Any

from llmserve.chat_template import ChatTemplateError
from llmserve.config.vision import VisionConfig
from llmserve.errors import RequestRejected
from llmserve.multimodal.images import ImageInput, take_images
from llmserve.multimodal.processors import (
    ImageProcessor,
    MergedImageProcessor,
    TiledImage,
    TiledImageProcessor,
)
from llmserve.tokenizer import Tokenizer

MEDIA_MARKER = "<__media__>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"  # Idefics3's, around each tile
GLOBAL_IMAGE_TAG = "<global-img>"  # before the whole image's tile


@dataclass(frozen=True)
class ImagePrompts:
    vision: VisionConfig
    processor: ImageProcessor | TiledImageProcessor | MergedImageProcessor
    marker: str  # an image in prompt text
    # the image token is the vocabulary's own (a Hugging Face vision-language checkpoint):
    # runs of it in token-id prompts are images; else the id only fills their positions
    token_in_vocabulary: bool
    # text around an image's run of image tokens (Gemma 3: its begin and end tokens)
    begin_text: str = ""
    end_text: str = ""

    @classmethod
    def build(cls, vision: VisionConfig,
              processor: ImageProcessor | TiledImageProcessor | MergedImageProcessor,
              tokenizer: Tokenizer) -> "ImagePrompts":
        if not vision.image_token_in_vocabulary:
            return cls(vision, processor, MEDIA_MARKER, False)

        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        if vision.pooled:
            begin, end = text(vision.begin_image_token_id), text(vision.end_image_token_id)
            return cls(vision, processor, begin, True, f"\n\n{begin}", f"{end}\n\n")
        return cls(vision, processor, text(vision.image_token_id), True)

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
        """Text with one marker per image -> its token ids, each marker an image's run(s)
        of image tokens in the text around them, and the images (tiles) placed on them.
        The text between runs is tokenized piece by piece, as the image token (an added
        token) splits it in the vocabulary."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise RequestRejected(f"the prompt has {len(pieces) - 1} image placeholder(s) "
                                  f"for {len(images)} image(s)")
        segments: list = [pieces[0]]  # text, a run, text, a run, ..., text
        for piece, image in zip(pieces[1:], images, strict=True):
            for part in self._expansion(self._input(image)):
                if isinstance(part, str):
                    segments[-1] += part
                else:
                    segments += [part, ""]
            segments[-1] += piece
        ids = tokenizer.encode(segments[0], add_special_tokens=add_special_tokens)
        placed = []
        for run, piece in zip(segments[1::2], segments[2::2], strict=True):
            size = self._size(run)
            placed.append(run.placed(len(ids), size))
            ids += [self.vision.image_token_id] * size
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        return ids, placed

    def _expansion(self, image: "ImageInput | TiledImage") -> list:
        """An image in the prompt: text, and its tiles, each a run of image tokens (see the
        module docstring)."""
        if not isinstance(image, TiledImage):
            return [self.begin_text, image, self.end_text]
        *tiles, whole = image.tiles
        parts: list = []
        for row in range(image.rows):
            for col in range(image.cols):
                parts += [f"{FAKE_IMAGE_TOKEN}<row_{row + 1}_col_{col + 1}>",
                          tiles[row * image.cols + col]]
            parts.append("\n")
        head = "\n" if tiles else ""
        return parts + [f"{head}{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TAG}", whole, FAKE_IMAGE_TOKEN]

    def place(self, ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """A token-id prompt and its images: images already placed (`encode`'s) are checked
        against the ids; otherwise each run of the image token (written once, expanded
        here, or `tokens_per_image` times) is the next image."""
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
        tiles = [t for image in images for t in self._tiles(self._input(image))]
        if len(runs) != len(tiles):
            of_tiles = f" of {len(tiles)} tiles" if self.vision.tiled else ""
            raise RequestRejected(f"the prompt has {len(runs)} image placeholder(s) for "
                                  f"{len(images)} image(s){of_tiles}")
        out: list[int] = []
        placed: list[ImageInput] = []
        last = 0
        exact = self.vision.pooled or self.vision.tiled  # runs as the processor writes them
        for (start, length), tile in zip(runs, tiles, strict=True):
            size = self._size(tile)
            if length != size and (length != 1 or exact):
                raise RequestRejected(
                    f"an image{' tile' if self.vision.tiled else ''} takes {size} image "
                    f"tokens in the prompt{'' if exact else ' (or one, expanded here)'}; a "
                    f"run has {length}")
            out += ids[last:start]
            placed.append(tile.placed(len(out), size))
            out += [token] * size
            last = start + length
        return out + ids[last:], placed

    def _check_placed(self, ids: list[int], images: list[ImageInput]
                      ) -> tuple[list[int], list[ImageInput]]:
        token, end = self.vision.image_token_id, 0
        for image in images:
            size = self._size(image)
            span = ids[image.offset:image.offset + image.length]
            if image.offset < end or image.length != size or span != [token] * size:
                raise RequestRejected("an image's place does not hold its image tokens")
            end = image.offset + image.length
        if self.token_in_vocabulary and ids.count(token) != sum(m.length for m in images):
            raise RequestRejected("the prompt holds image tokens that no image fills (an "
                                  "earlier answer's context with its images?)")
        return ids, images

    def _size(self, image: ImageInput) -> int:
        """The image tokens `image` takes (Qwen2.5-VL's: by its size)."""
        return image.num_tokens or self.vision.tokens_per_image

    def _input(self, image: Any) -> "ImageInput | TiledImage":
        """A `PIL.Image` preprocessed; an `ImageInput` or `TiledImage` as it is."""
        if isinstance(image, ImageInput | TiledImage):
            return image
        return self.processor.image_input(image)

    @staticmethod
    def _tiles(image: "ImageInput | TiledImage") -> list[ImageInput]:
        return image.tiles if isinstance(image, TiledImage) else [image]


def _flattened(message: dict[str, Any], marker: str) -> dict[str, Any]:
    """A message of parts as one string: its images' markers, then its text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    images = sum(1 for p in content if p.get("type") == "image")
    text = "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return {**message, "content": f"{marker}\n" * images + text}
