"""The vision encoder's outputs by image content hash, so that an image is encoded once
however its prompt is chunked, preempted and resumed, or repeated by other requests.

    rows_for(scheduled images) -> each image's rows (tokens_per_image, hidden)
        the step's images not held are encoded (`encode`), one at a time: an image's rows
        never depend on which others a step encodes (a GEMM may block its rows
        differently by their count)
        least recently used images beyond `max_rows` rows are dropped (never this step's)
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from llmserve.multimodal import ImageInput

# images' rows kept: 16 of LLaVA-1.5's 576-token images
DEFAULT_MAX_ROWS = 16 * 576


class EncoderCache:
    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor],
                 max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.encode = encode  # (N, C, S, S) -> (N, tokens_per_image, hidden)
        self.max_rows = max_rows
        self.rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images the encoder ran on (a hit costs none)

    def rows_for(self, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
        """Every image's rows by hash, the missing ones encoded now, one by one."""
        missing: dict[str, ImageInput] = {}
        for image in images:
            if image.hash in self.rows:
                self.rows.move_to_end(image.hash)
            else:
                missing.setdefault(image.hash, image)
        for key, image in missing.items():
            self.rows[key] = self.encode(image.pixel_values.unsqueeze(0))[0]
            self.num_encoded += 1
        wanted = {image.hash for image in images}
        held = sum(r.shape[0] for r in self.rows.values())
        for key in list(self.rows):
            if held <= self.max_rows:
                break
            if key not in wanted:
                held -= self.rows.pop(key).shape[0]
        return {key: self.rows[key] for key in wanted}
