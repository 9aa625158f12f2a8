"""Images into a vision-language model's inputs: decoding untrusted bytes with caps, the
checkpoint's preprocessing (resize, crop, rescale, normalise: transformers' PIL image
processors, reproduced to the bit), and `ImageInput`, what a request carries per image.

Decoding and preprocessing run where the prompt is tokenized (the server's tokenizer
pool), never on the engine's thread; the vision tower runs in the model runner.
"""

import base64
import binascii
import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.config.vision import VisionConfig
from llmserve.errors import LLMServeError, ModelFormatError

# per image: the encoded bytes and the decoded pixels (PIL's own bomb check stops at 2x
# its limit; ours refuses before any pixel is decoded)
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES_PER_REQUEST = 16
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
BILINEAR = 2  # Gemma 3's processor's default
BICUBIC = 3  # CLIP's and SigLIP's processors' default


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
    sit: prompt positions `offset .. offset + length - 1`, all the image token."""

    pixel_values: Any  # torch.Tensor (C, S, S) float32
    hash: str
    offset: int = 0
    length: int = 0

    def placed(self, offset: int, length: int) -> "ImageInput":
        return ImageInput(self.pixel_values, self.hash, offset, length)


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


@dataclass(frozen=True)
class ImageProcessor:
    """A checkpoint's preprocessing (`preprocessor_config.json`: CLIP's resize of the
    shortest edge then centre crop, SigLIP's resize to a fixed size), as transformers' PIL
    processors run it: PIL resize of the 8-bit RGB image, crop, x rescale_factor in
    float64 then float32, (x - mean) / std in float32."""

    size: tuple[int, int] | None  # (height, width): resized to exactly this
    shortest_edge: int | None  # else: the shorter side resized to this, aspect kept
    resample: int
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def for_model(cls, folder: Path | None, vision: VisionConfig) -> "ImageProcessor":
        """From the folder's preprocessor_config.json; without one (a GGUF), the tower's
        own defaults at its image size."""
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        if path is None or not path.is_file():
            side = vision.image_size
            if vision.tower == "clip":
                return cls(None, side, BICUBIC, (side, side), 1 / 255, OPENAI_CLIP_MEAN,
                           OPENAI_CLIP_STD)
            return cls((side, side), None, BILINEAR if vision.pooled else BICUBIC, None,
                       1 / 255, (0.5,) * 3, (0.5,) * 3)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"cannot read {path}: {e}") from None
        return cls.from_config(cfg, vision, path)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision: VisionConfig,
                    source: Any = "preprocessor_config.json") -> "ImageProcessor":
        if not isinstance(cfg, dict):
            raise ModelFormatError(f"{source} is not a JSON object")
        clip = vision.tower == "clip"
        for flag in ("do_pad", "do_image_splitting", "do_pan_and_scan"):
            if cfg.get(flag):
                raise ModelFormatError(f"{source}: {flag} is not supported")
        size = cfg.get("size", {"shortest_edge": vision.image_size} if clip else
                       {"height": vision.image_size, "width": vision.image_size})
        if isinstance(size, int):
            size = {"height": size, "width": size}
        fixed = shortest = None
        if cfg.get("do_resize", True):
            if isinstance(size, dict) and "height" in size and "width" in size:
                fixed = (int(size["height"]), int(size["width"]))
            elif isinstance(size, dict) and "shortest_edge" in size:
                shortest = int(size["shortest_edge"])
            else:
                raise ModelFormatError(f"{source}: unsupported size {size!r}")
        crop = None
        if cfg.get("do_center_crop", clip):
            c = cfg.get("crop_size", {"height": vision.image_size, "width": vision.image_size})
            c = {"height": c, "width": c} if isinstance(c, int) else c
            crop = (int(c["height"]), int(c["width"]))
        resample = cfg.get("resample", BILINEAR if vision.pooled else BICUBIC)
        if resample not in RESAMPLE:
            raise ModelFormatError(f"{source}: unsupported resample {resample!r}")
        default_mean = OPENAI_CLIP_MEAN if clip else (0.5,) * 3
        default_std = OPENAI_CLIP_STD if clip else (0.5,) * 3
        normalize = cfg.get("do_normalize", True)
        processor = cls(
            fixed, shortest, resample, crop,
            float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            tuple(cfg.get("image_mean", default_mean)) if normalize else None,
            tuple(cfg.get("image_std", default_std)) if normalize else None)
        side = processor.output_side
        if side != (vision.image_size, vision.image_size):
            raise ModelFormatError(f"{source}: images come out {side[0]}x{side[1]}; the "
                                   f"vision tower takes {vision.image_size}x"
                                   f"{vision.image_size}")
        return processor

    @property
    def output_side(self) -> tuple[int, int]:
        if self.crop is not None:
            return self.crop
        if self.size is not None:
            return self.size
        return (self.shortest_edge or 0, self.shortest_edge or 0)

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB `PIL.Image` -> (3, H, W) float32 pixel values."""
        from PIL import Image

        if self.size is not None or self.shortest_edge is not None:
            height, width = self.size or _shortest_edge_size(image.height, image.width,
                                                             self.shortest_edge)
            image = image.resize((width, height),
                                 resample=getattr(Image.Resampling, RESAMPLE[self.resample]))
        pixels = np.moveaxis(np.asarray(image), -1, 0)  # (3, H, W) uint8
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        if self.rescale_factor is not None:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.mean is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels))

    def image_input(self, image: Any) -> ImageInput:
        """`image` preprocessed and hashed (its place in a prompt set later)."""
        pixels = self(image)
        return ImageInput(pixels, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())


def _shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) cropped about its centre to (C, height, width), zero-padded where smaller
    (as transformers crops)."""
    _, h, w = pixels.shape
    if h < height or w < width:
        padded = np.zeros((pixels.shape[0], max(h, height), max(w, width)), pixels.dtype)
        top, left = -(-(padded.shape[1] - h) // 2), -(-(padded.shape[2] - w) // 2)
        padded[:, top:top + h, left:left + w] = pixels
        pixels, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top:top + height, left:left + width]
