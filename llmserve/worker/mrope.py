"""M-RoPE positions (Qwen2.5-VL): where a request's tokens sit for the decoder's rotary
embedding when its prompt holds images.

A text token has one position, the same in all three of M-RoPE's rows (temporal, row,
column); an image's tokens (a grid of `rows` x `cols`, in row order) share the temporal
position the image starts at and take that plus their row and column; the text after an
image goes on from the start plus the image's longer side, so each image shifts every
later position by max(rows, cols) - rows * cols (as transformers' `get_rope_index`). A
position depends only on the tokens and images before it, so a prefix-cache hit holds
keys rotated as a miss would rotate them.

A step holding no image token needs one row (the native stack and the in-place rotation
run as for any text model); a step with one gets all three.
"""

from collections.abc import Sequence

import numpy as np
import torch

from llmserve.multimodal.images import ImageInput


def positions_of(images: Sequence[ImageInput], start: int, count: int) -> np.ndarray:
    """(3, count) positions of sequence indices `start .. start + count - 1` of a request
    whose prompt holds `images` (placed, with their token grids)."""
    index = np.arange(start, start + count, dtype=np.int64)
    out = np.broadcast_to(index, (3, count)).copy()
    shift = 0  # how far the images so far moved the positions after them
    for image in sorted(images, key=lambda m: m.offset):
        rows, cols = image.grid
        end = image.offset + image.length
        inside = (index >= image.offset) & (index < end)
        if inside.any():
            local = index[inside] - image.offset
            first = image.offset + shift
            out[0, inside] = first
            out[1, inside] = first + local // cols
            out[2, inside] = first + local % cols
        moved = max(rows, cols) - image.length
        out[:, index >= end] += moved
        shift += moved
    return out


def step_positions(positions: torch.Tensor, chunks: Sequence[tuple[int, int, int, list]]
                   ) -> torch.Tensor:
    """A step's rotary positions from its sequence positions (T,): `chunks` holds, for
    each scheduled request with images, (its first token's index in the step, its first
    sequence index, its token count, its images). (T,) where no image token is in the
    step, else (3, T)."""
    if not chunks:
        return positions
    flat = positions.cpu().numpy()
    rows = np.broadcast_to(flat, (3, len(flat))).copy()
    has_image_token = False
    for first, start, count, images in chunks:
        rows[:, first:first + count] = positions_of(images, start, count)
        has_image_token |= any(m.offset < start + count and start < m.offset + m.length
                               for m in images)
    out = rows if has_image_token else rows[0]
    return torch.from_numpy(np.ascontiguousarray(out)).to(positions.device)
