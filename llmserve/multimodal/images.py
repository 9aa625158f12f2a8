"""Images as requests carry them: decoding untrusted bytes with caps (size, pixels, format),
a chat's image parts taken out in prompt order, and `ImageInput`, what a request carries
per image (its preprocessed pixels, content hash and place in the prompt).

Decoding runs where the prompt is tokenized (the server's tokenizer pool), never on the
engine's thread; the checkpoint's preprocessing is `processors.py`'s.
"""

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

from llmserve.errors import LLMServeError

# per image: the encoded bytes and the decoded pixels (PIL's own bomb check stops at 2x
# its limit; ours refuses before any pixel is decoded)
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES_PER_REQUEST = 16



class ImageError(LLMServeError, ValueError):
    """An image that cannot be used (not an image, truncated, too large, too many);
    `param`: the request part it came from, where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: its preprocessed pixels, their content hash (which keys the
    encoder cache and, with the token ids, the prefix cache's blocks) and where its tokens
    sit: prompt positions `offset .. offset + length - 1`, all the image token.
    Qwen2.5-VL's (`MergedImageProcessor`): the pixels are the image's patches, (patches,
    C x frames x patch x patch) in merge-block order, and `grid` its tokens' (rows,
    columns), `length` = rows x columns."""

    pixel_values: Any  # torch.Tensor (C, S, S) float32; Qwen2.5-VL's: (patches, width)
    hash: str
    offset: int = 0
    length: int = 0
    grid: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int | None:
        """The tokens the image takes where its size sets them (Qwen2.5-VL); None: the
        model's `tokens_per_image`."""
        return None if self.grid is None else self.grid[0] * self.grid[1]

    def placed(self, offset: int, length: int) -> "ImageInput":
        return ImageInput(self.pixel_values, self.hash, offset, length, self.grid)


# chat content parts that carry an image: OpenAI's image_url, the Responses API's
# input_image, an offline caller's {"type": "image", "image": <PIL image>}
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages as templates take them with images: every content a list of parts,
    each image part `{"type": "image"}`; and the images in prompt order (decoded: RGB
    `PIL.Image`s). A bad image is an `ImageError` naming its part."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message if content is None else
                       {**message, "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            try:
                images.append(_part_image(part))
            except ImageError as e:
                where = f"messages[{i}].content[{j}]"
                raise ImageError(f"{where}: {e}", param=where) from None
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    if len(images) > MAX_IMAGES_PER_REQUEST:
        raise ImageError(f"{len(images)} images in one request; at most "
                         f"{MAX_IMAGES_PER_REQUEST}", param="messages")
    return out, images


def _part_image(part: dict[str, Any]) -> Any:
    image = part.get("image")
    if image is not None and not isinstance(image, str | dict):
        return to_rgb(image)  # an offline caller's PIL image
    url = part.get("image_url", image)
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise ImageError("the image part has no URL")
    if url.startswith(("http://", "https://")):
        raise ImageError("images are taken as data URLs (data:image/png;base64,...) here; "
                         "a server fetches http(s) URLs from its --allowed-media-domains")
    return decode_data_url(url)


def decode_image(data: bytes) -> Any:
    """Bytes (PNG, JPEG, WebP, GIF's first frame, ...) -> an RGB `PIL.Image`, refused with
    an `ImageError` when not an image, truncated, over MAX_IMAGE_BYTES or
    MAX_IMAGE_PIXELS (the header's size, before decoding: a decompression bomb)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; at most {MAX_IMAGE_BYTES}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageError(f"the image is {width}x{height} pixels; at most "
                                 f"{MAX_IMAGE_PIXELS} pixels")
            image.load()
            return to_rgb(image)  # a mode with no RGB conversion is refused here too
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not a usable image: not in a format the server reads (PNG, "
                         "JPEG, WebP, GIF, BMP, ...)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"not a usable image: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated, corrupt
        raise ImageError(f"the image cannot be decoded: {e}") from None


def decode_data_url(url: str) -> Any:
    """A `data:image/...;base64,...` URL -> `decode_image` of its bytes."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ImageError("an image URL must be a base64 data URL (data:image/png;base64,...)")
    return decode_image(decode_base64(payload))


def decode_base64(payload: str) -> bytes:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image is over {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's base64 data is not valid base64") from None


def to_rgb(image: Any) -> Any:
    """RGB, transparency composited onto white (as transformers converts)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")
