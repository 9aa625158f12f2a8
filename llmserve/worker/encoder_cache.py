"""The vision encoder's outputs by image content hash, so that an image is encoded once
however its prompt is chunked, preempted and resumed, or repeated by other requests; and
the encodes in progress, a slice at a time, so that no step stops for a whole image.

    advance(asked images, budget_s) -> the hashes finished
        slices of the asked images' encodes (`encode_slices`), in the order asked, until
        the step's encoder time is spent (at least one slice a step): an image waits
        for its rows (`core/image_encodes.py`) while the others' tokens go on
    rows_for(scheduled images) -> each image's rows (tokens_per_image, hidden)
        an image not held is encoded whole now (the scheduler asks first, so only a caller
        that drives the runner without it gets here)
    drop(hashes)    the scheduler's evictions, finished rows or encodes part-done

Each image is encoded alone, from its own pixels: its rows never depend on which others
run beside it (a GEMM may block its rows differently by their count) nor on how its
slices are spread over steps (the same ops in the same order).
"""

import time
from collections.abc import Callable, Generator, Iterable, Sequence

import torch

from llmserve.models.vision import run_slices
from llmserve.multimodal.images import ImageInput

# encoder time a step spends beside other requests' tokens (at least one slice: a layer's
# attention or its MLP, ~0.1 s for a 4,096-patch SigLIP-400M image in bfloat16 on 2 cores),
# and with no other tokens to compute (a request arriving meanwhile waits at most this)
STEP_BUDGET_S = 0.05
IDLE_BUDGET_S = 0.5

Slices = Generator[None, None, torch.Tensor]


class EncoderCache:
    def __init__(self, encode_slices: Callable[[ImageInput], Slices]) -> None:
        self.encode_slices = encode_slices  # an image -> its rows (1, tokens, hidden)
        self.rows: dict[str, torch.Tensor] = {}
        self.jobs: dict[str, Slices] = {}  # encodes part-done, by hash
        self.num_encoded = 0  # images the encoder ran on (a hit costs none)
        self.num_slices = 0  # slices `advance` ran

    def advance(self, images: Sequence[ImageInput], budget_s: float) -> list[str]:
        """Run slices of `images`' encodes, first asked first, until `budget_s` is spent
        (at least one); returns the hashes whose rows are ready, held ones included."""
        done = [image.hash for image in images if image.hash in self.rows]
        deadline = time.perf_counter() + budget_s
        for image in images:
            if image.hash in self.rows:
                continue
            job = self.jobs.get(image.hash)
            if job is None:
                job = self.jobs[image.hash] = self.encode_slices(image)
            while True:
                try:
                    next(job)
                    self.num_slices += 1
                except StopIteration as finished:
                    self._hold(image.hash, finished.value)
                    done.append(image.hash)
                    break
                if time.perf_counter() >= deadline:
                    return done
        return done

    def rows_for(self, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
        """Every image's rows by hash; one not held is encoded now (its slices back to
        back, from where an encode in progress stands)."""
        for image in images:
            if image.hash not in self.rows:
                job = self.jobs.get(image.hash) or self.encode_slices(image)
                self._hold(image.hash, run_slices(job))
        return {image.hash: self.rows[image.hash] for image in images}

    def drop(self, hashes: Iterable[str]) -> None:
        for key in hashes:
            self.rows.pop(key, None)
            self.jobs.pop(key, None)

    def _hold(self, key: str, rows: torch.Tensor) -> None:
        self.jobs.pop(key, None)
        self.rows[key] = rows[0]
        self.num_encoded += 1
