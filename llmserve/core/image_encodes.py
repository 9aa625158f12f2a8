"""The scheduler's side of the image encoder: which images' rows the runner holds, which
it is encoding, and which it drops. Decided here, as the KV blocks are, so the runner only
does as told (`worker/encoder_cache.py`).

A request whose next tokens reach an image the runner does not hold stops short of it
(its text before the image is computed meanwhile) and the image is asked for
(`SchedulerOutput.encode_images`). The runner encodes the asked images a slice at a time
beside the step's other tokens and names the ones it finished
(`ModelRunnerOutput.encoded_images`); their requests go on from the next step. So one
request's images never hold the other requests' tokens back for more than a slice a step.

Held rows beyond `max_rows` are dropped least recently used first, never those of an image
that an unfinished request has still to compute; an asked image that no unfinished request
needs any more (its request was aborted) is dropped part-done.
"""

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

# images' rows kept beyond those still needed: 16 of LLaVA-1.5's 576-token images
DEFAULT_MAX_ROWS = 16 * 576


class ImageEncodes:
    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.max_rows = max_rows
        self.held: OrderedDict[str, int] = OrderedDict()  # hash -> rows, least recent first
        self.asked: dict[str, Any] = {}  # hash -> the ImageInput being encoded, oldest first

    def ready(self, image: Any) -> bool:
        """Whether the runner holds `image`'s rows; if not, it is asked for."""
        if image.hash in self.held:
            self.held.move_to_end(image.hash)
            return True
        self.asked.setdefault(image.hash, image)
        return False

    def finish_output(self, out: Any, requests: Iterable[Any]) -> None:
        """The step's asks and drops (`requests`: every unfinished request, its tokens of
        this step counted as computed; the runner drops after the step's forward)."""
        if not (self.asked or self.held):
            return  # (a text model's steps: nothing to look through)
        needed = {image.hash for r in requests for image in r.mm_inputs
                  if image.offset + image.length > r.num_computed_tokens}
        drops = [key for key in self.asked if key not in needed]
        for key in drops:
            del self.asked[key]
        num_rows = sum(self.held.values())
        for key in list(self.held):
            if num_rows <= self.max_rows:
                break
            if key not in needed:
                num_rows -= self.held.pop(key)
                drops.append(key)
        out.encode_images = list(self.asked.values())
        out.drop_images = drops

    def update(self, encoded: Iterable[str]) -> None:
        """The runner finished these asked images' rows."""
        for key in encoded:
            image = self.asked.pop(key, None)
            if image is not None:
                self.held[key] = image.length
