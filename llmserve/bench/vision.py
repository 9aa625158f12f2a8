"""`llmserve bench vision`: one-image chats against any OpenAI-compatible server (llmserve,
llama.cpp's `llama-server --mmproj`, vLLM), and the image encoder's own time in process.

* **Serving**: at each level of concurrent streams, `requests_per_stream` chats per stream,
  each with an image of its own (random pixels: never a cache hit) and a short question,
  streamed, greedy, `output_len` tokens (ignore_eos); TTFT p50 and output tokens a second
  over the level's wall time.
* **Encode** (`encode_image_ms`, in process): the vision tower and projector on one
  preprocessed image, the median of `repeats` runs after one warm-up.
"""

import base64
import io
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from llmserve.errors import LLMServeError

QUESTION = "Describe this picture in detail."


@dataclass(frozen=True)
class VisionBenchConfig:
    base_url: str  # the server's root (…/v1 is appended)
    model: str
    streams: tuple[int, ...] = (1, 16)
    requests_per_stream: int = 2
    output_len: int = 32
    image_side: int = 512  # the random images' width and height, in pixels
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1 or self.requests_per_stream < 1:
            raise ValueError("--streams and --requests-per-stream must be at least 1")


def random_png(side: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _chat_body(config: VisionBenchConfig, image: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": config.model, "stream": True, "temperature": 0,
            "max_tokens": config.output_len, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTION}]}]}


def _one_chat(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, float]:
    start = time.monotonic()
    first = None
    tokens = 0
    with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise LLMServeError(f"{response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None and '"content"' in line and '"content":""' not in \
                    line.replace(" ", ""):
                first = time.monotonic() - start
            if '"usage"' in line and '"completion_tokens"' in line:
                import json

                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    if first is None:
        raise LLMServeError("no token came back")
    return {"ttft_s": first, "tokens": tokens, "seconds": time.monotonic() - start}


def one_level(config: VisionBenchConfig, streams: int, images: list[bytes]
              ) -> dict[str, Any]:
    """`streams` concurrent streams, each sending its share of `images` one after another."""
    url = f"{config.base_url.rstrip('/')}/v1/chat/completions"
    records: list[dict[str, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def stream(index: int) -> None:
        with httpx.Client(timeout=1800) as http:
            for image in images[index::streams]:
                try:
                    record = _one_chat(http, url, _chat_body(config, image))
                except (LLMServeError, httpx.HTTPError) as e:
                    with lock:
                        errors.append(str(e))
                    return
                with lock:
                    records.append(record)

    start = time.monotonic()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    if errors:
        raise LLMServeError(f"{len(errors)} request(s) failed: {errors[0]}")
    tokens = sum(r["tokens"] for r in records)
    return {"streams": streams, "requests": len(records), "wall_s": wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in records),
            "output_tokens": tokens, "tok_s": tokens / wall}


def run_vision_bench(config: VisionBenchConfig) -> dict[str, Any]:
    """A warm-up chat, then each level with images no level has sent."""
    runs = []
    seed = config.seed * 100_000
    one_level(config, 1, [random_png(config.image_side, seed)])  # warm-up
    for streams in config.streams:
        count = streams * config.requests_per_stream
        images = [random_png(config.image_side, seed + 1 + len(runs) * 1000 + i)
                  for i in range(count)]
        runs.append(one_level(config, streams, images))
    return {"config": {"base_url": config.base_url, "model": config.model,
                       "streams": list(config.streams),
                       "requests_per_stream": config.requests_per_stream,
                       "output_len": config.output_len, "image_side": config.image_side},
            "runs": runs}


def encode_image_ms(model: str, mmproj: str | None = None, repeats: int = 3,
                    image_side: int = 512) -> dict[str, Any]:
    """The vision tower and projector on one image, in this process (ms, median)."""
    import torch
    from PIL import Image

    from llmserve.llm import LLM

    llm = LLM(model, mmproj=mmproj, kv_cache_memory="64MiB")
    prompts = llm.engine.input_processor.images
    if prompts is None:
        raise LLMServeError(f"{model} takes no images")
    image = Image.open(io.BytesIO(random_png(image_side, 7))).convert("RGB")
    pixels = prompts.processor(image)  # (3, S, S), or an Idefics3 image's (tiles, 3, S, S)
    pixels = pixels.unsqueeze(0) if pixels.dim() == 3 else pixels
    model_ = llm.engine.loaded.model
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            model_.encode_images(pixels)
            if i:
                times.append((time.perf_counter() - start) * 1000)
    vision = llm.engine.loaded.config.vision
    return {"encode_ms": statistics.median(times), "runs_ms": times,
            "tokens_per_image": vision.tokens_per_image * pixels.shape[0],
            "tiles": pixels.shape[0], "tower": vision.tower,
            "tower_layers": vision.num_hidden_layers, "tower_hidden": vision.hidden_size}


def format_vision_bench(report: dict[str, Any]) -> str:
    lines = [f"one-image chats against {report['config']['base_url']} "
             f"({report['config']['model']}), {report['config']['output_len']} output tokens"]
    if "encode" in report:
        e = report["encode"]
        lines.append(f"image encode (in process): {e['encode_ms']:.0f} ms per image "
                     f"({e['tower']} tower, {e['tower_layers']} layers x {e['tower_hidden']}, "
                     f"{e['tokens_per_image']} tokens)")
    lines.append(f"  {'streams':>7} {'requests':>9} {'TTFT p50 s':>11} {'tok/s':>8} "
                 f"{'wall s':>8}")
    for run in report["runs"]:
        lines.append(f"  {run['streams']:>7} {run['requests']:>9} {run['ttft_p50_s']:>11.2f} "
                     f"{run['tok_s']:>8.2f} {run['wall_s']:>8.1f}")
    return "\n".join(lines)
