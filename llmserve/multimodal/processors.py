"""A checkpoint's image preprocessing, transformers' PIL image processors reproduced to the
bit: CLIP's and SigLIP's resize, crop, rescale and normalise (`ImageProcessor`),
Idefics3's tiling (`TiledImageProcessor`), Qwen2.5-VL's resize to merged patches and
patch order (`MergedImageProcessor`). Each turns a decoded image into its `ImageInput`
(or an Idefics3 image's tiles), hashed by content.
"""

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.config.vision import VisionConfig
from llmserve.errors import ModelFormatError
from llmserve.multimodal.images import ImageError, ImageInput

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
LANCZOS = 1  # Idefics3's processor's default
BILINEAR = 2  # Gemma 3's processor's default
BICUBIC = 3  # CLIP's and SigLIP's processors' default


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
    def for_model(cls, folder: Path | None, vision: VisionConfig
                  ) -> "ImageProcessor | TiledImageProcessor | MergedImageProcessor":
        """From the folder's preprocessor_config.json; without one (a GGUF), the tower's
        own defaults at its image size. Idefics3's: a `TiledImageProcessor`; Qwen2.5-VL's:
        a `MergedImageProcessor`."""
        path = None if folder is None else Path(folder) / "preprocessor_config.json"
        if vision.merged:
            return MergedImageProcessor.from_config(
                _read_config(path) if path is not None and path.is_file() else {}, vision,
                path or "the tower's defaults")
        if vision.tiled:
            return TiledImageProcessor.from_config(
                _read_config(path) if path is not None and path.is_file() else {}, vision,
                path or "the tower's defaults")
        if path is None or not path.is_file():
            side = vision.image_size
            if vision.tower == "clip":
                return cls(None, side, BICUBIC, (side, side), 1 / 255, OPENAI_CLIP_MEAN,
                           OPENAI_CLIP_STD)
            return cls((side, side), None, BILINEAR if vision.pooled else BICUBIC, None,
                       1 / 255, (0.5,) * 3, (0.5,) * 3)
        return cls.from_config(_read_config(path), vision, path)

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
        return _rescaled(pixels, self.rescale_factor, self.mean, self.std)

    def image_input(self, image: Any) -> ImageInput:
        """`image` preprocessed and hashed (its place in a prompt set later)."""
        pixels = self(image)
        return ImageInput(pixels, hashlib.sha256(pixels.numpy().tobytes()).hexdigest())


def _read_config(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from None


def _rescaled(pixels: np.ndarray, rescale_factor: float | None, mean: tuple | None,
              std: tuple | None) -> torch.Tensor:
    """(3, H, W) uint8 -> float32: x rescale_factor in float64 then float32, (x - mean) /
    std in float32 (transformers' NumPy rescale and normalize)."""
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if mean is not None:
        pixels = (pixels - np.array(mean, dtype=np.float32)[:, None, None]) / \
            np.array(std, dtype=np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray(pixels))


@dataclass(frozen=True)
class TiledImage:
    """An image as Idefics3's processor splits it: `rows` x `cols` tiles in row order,
    then the whole image shrunk to one tile (`rows` = `cols` = 0: that one tile alone).
    Each tile is an `ImageInput` of its own: its own run of image tokens, encoded and
    cached by its own content hash."""

    tiles: list[ImageInput]
    rows: int
    cols: int


MAX_TILED_SIDE = 4096  # Idefics3's processor: no side past this after its first resize


@dataclass(frozen=True)
class TiledImageProcessor:
    """Idefics3's / SmolVLM's preprocessing (`Idefics3ImageProcessor`, PIL): the longest
    edge resized to `longest_edge` (the other side in proportion, rounded up to even), then
    with `split` each side up to a multiple of `tile` and the image cut into `tile`-sized
    tiles plus the whole image resized to one tile (without `split`: resized to one tile);
    each tile rescaled and normalised. Pixel values bit-equal to transformers'."""

    longest_edge: int | None  # None: no first resize
    tile: int
    split: bool
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, cfg: Any, vision: VisionConfig,
                    source: Any = "preprocessor_config.json") -> "TiledImageProcessor":
        if not isinstance(cfg, dict):
            raise ModelFormatError(f"{source} is not a JSON object")

        def edge(key: str, default: int) -> int:
            value = cfg.get(key, {"longest_edge": default})
            value = value.get("longest_edge") if isinstance(value, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"{source}: {key} must hold a positive longest_edge")
            return value

        tile = edge("max_image_size", vision.image_size)
        if tile != vision.image_size:
            raise ModelFormatError(f"{source}: tiles of {tile} px; the vision tower takes "
                                   f"{vision.image_size}")
        resample = cfg.get("resample", LANCZOS)
        if resample not in RESAMPLE:
            raise ModelFormatError(f"{source}: unsupported resample {resample!r}")
        normalize = cfg.get("do_normalize", True)
        return cls(
            edge("size", 4 * tile) if cfg.get("do_resize", True) else None, tile,
            bool(cfg.get("do_image_splitting", True)), resample,
            float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            tuple(cfg.get("image_mean", (0.5,) * 3)) if normalize else None,
            tuple(cfg.get("image_std", (0.5,) * 3)) if normalize else None)

    def tiles(self, image: Any) -> tuple[list[torch.Tensor], int, int]:
        """An RGB `PIL.Image` -> its tiles' (3, tile, tile) float32 pixel values (the
        whole image's last), rows, cols."""
        from PIL import Image

        resample = getattr(Image.Resampling, RESAMPLE[self.resample])

        def resized(img: Any, height: int, width: int) -> Any:
            return img.resize((width, height), resample=resample)

        if self.longest_edge is not None:
            image = resized(image, *_longest_edge_size(image.height, image.width,
                                                       self.longest_edge))
        if not self.split:
            frames, rows, cols = [resized(image, self.tile, self.tile)], 0, 0
        else:
            image = resized(image, *_tile_multiple_size(image.height, image.width, self.tile))
            if image.height > self.tile or image.width > self.tile:
                rows = (image.height - self.tile) // self.tile + 1
                cols = (image.width - self.tile) // self.tile + 1
                whole = np.moveaxis(np.asarray(image), -1, 0)
                frames = [whole[:, r * self.tile:(r + 1) * self.tile,
                                c * self.tile:(c + 1) * self.tile]
                          for r in range(rows) for c in range(cols)]
                frames.append(resized(image, self.tile, self.tile))
            else:
                frames, rows, cols = [image], 0, 0
        pixels = [f if isinstance(f, np.ndarray) else np.moveaxis(np.asarray(f), -1, 0)
                  for f in frames]
        return ([_rescaled(f, self.rescale_factor, self.mean, self.std) for f in pixels],
                rows, cols)

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB `PIL.Image` -> (tiles, 3, tile, tile) float32 pixel values."""
        return torch.stack(self.tiles(image)[0])

    def image_input(self, image: Any) -> TiledImage:
        tiles, rows, cols = self.tiles(image)
        return TiledImage([ImageInput(t, hashlib.sha256(t.numpy().tobytes()).hexdigest())
                           for t in tiles], rows, cols)


# Qwen2.5-VL's processor's pixel bounds (transformers' defaults; checkpoints set their own)
MERGED_MIN_PIXELS = 56 * 56
MERGED_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class MergedImageProcessor:
    """Qwen2.5-VL's preprocessing (`Qwen2VLImageProcessor`, PIL): the image resized to
    sides that are multiples of a merged patch (28 px), as close to its own as the pixel
    bounds allow (`smart_resize`), rescaled and normalised, then cut into patches in
    merge-block order, each patch repeated over `temporal_patch_size` frames. Pixel values
    bit-equal to transformers'."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    resample: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, cfg: Any, vision: VisionConfig,
                    source: Any = "preprocessor_config.json") -> "MergedImageProcessor":
        if not isinstance(cfg, dict):
            raise ModelFormatError(f"{source} is not a JSON object")
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        low = cfg.get("min_pixels", size.get("shortest_edge", MERGED_MIN_PIXELS))
        high = cfg.get("max_pixels", size.get("longest_edge", MERGED_MAX_PIXELS))
        for name, value in (("min_pixels", low), ("max_pixels", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"{source}: {name} must be a positive integer")
        for key, own in (("patch_size", vision.patch_size),
                         ("merge_size", vision.spatial_merge_size),
                         ("temporal_patch_size", vision.temporal_patch_size)):
            if cfg.get(key, own) != own:
                raise ModelFormatError(f"{source}: {key} {cfg[key]!r}; the vision tower's "
                                       f"is {own}")
        if not cfg.get("do_resize", True):
            raise ModelFormatError(f"{source}: do_resize false is not supported")
        resample = cfg.get("resample", BICUBIC)
        if resample not in RESAMPLE:
            raise ModelFormatError(f"{source}: unsupported resample {resample!r}")
        normalize = cfg.get("do_normalize", True)
        return cls(
            low, max(high, low), vision.patch_size, vision.spatial_merge_size,
            vision.temporal_patch_size, resample,
            float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)) if normalize else None,
            tuple(cfg.get("image_std", OPENAI_CLIP_STD)) if normalize else None)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: sides that are multiples of a merged patch, the
        pixels within the bounds, the aspect kept as near as that allows."""
        factor = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ImageError(f"the image is {width}x{height}: a side more than "
                             f"{MAX_ASPECT_RATIO} times the other")
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def __call__(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """An RGB `PIL.Image` -> its patches (patches, C x frames x patch x patch) float32
        and its tokens' grid (rows, columns)."""
        from PIL import Image

        height, width = self.resized_size(image.height, image.width)
        image = image.resize((width, height),
                             resample=getattr(Image.Resampling, RESAMPLE[self.resample]))
        pixels = _rescaled(np.moveaxis(np.asarray(image), -1, 0), self.rescale_factor,
                           self.mean, self.std).numpy()
        channels, p, m = pixels.shape[0], self.patch_size, self.merge_size
        rows, cols = height // p // m, width // p // m
        patches = pixels.reshape(channels, rows, m, p, cols, m, p)
        patches = np.transpose(patches, (1, 4, 2, 5, 0, 3, 6))  # (rows, cols, m, m, C, p, p)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (
            *patches.shape[:5], self.temporal_patch_size, p, p))
        flat = patches.reshape(rows * cols * m * m, channels * self.temporal_patch_size * p * p)
        return torch.from_numpy(np.ascontiguousarray(flat)), (rows, cols)

    def image_input(self, image: Any) -> ImageInput:
        """`image` preprocessed and hashed (its grid in the hash: the same patches in
        another arrangement are another image)."""
        patches, grid = self(image)
        digest = hashlib.sha256(patches.numpy().tobytes())
        digest.update(f"{grid[0]}x{grid[1]}".encode())
        return ImageInput(patches, digest.hexdigest(), grid=grid)


def _longest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """The longest side to `edge`, the other in proportion rounded up to even (at least
    1), then both under MAX_TILED_SIDE (transformers' Idefics3 resize rules)."""
    aspect = width / height
    if width >= height:
        width = edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_TILED_SIDE:
        width = MAX_TILED_SIDE
        height = int(width / aspect)
    elif height > width and height > MAX_TILED_SIDE:
        height = MAX_TILED_SIDE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Each side up to a multiple of `tile`, the shorter after keeping the aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


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
