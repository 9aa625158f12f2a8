"""`llmserve bench vision`: one-image chats against any OpenAI-compatible server (llmserve,
llama.cpp's `llama-server --mmproj`, vLLM), and the image encoder's own time in process.

* **Serving**: at each level of concurrent streams, `requests_per_stream` chats per stream,
  each with an image of its own (random pixels: never a cache hit) and a short question,
  streamed, greedy, `output_len` tokens (ignore_eos); TTFT p50 and output tokens a second
  over the level's wall time.
* **Beside** (`beside_images`, with `beside` text streams): text chats streaming while
  one-image chats run one after another; the longest time no text stream got a token
  and their gaps between tokens, against the same alone (an image encoded inside one
  step stalls every stream).
* **Encode** (`encode_image_ms`, in process): the vision tower and projector on one
  preprocessed image, the median of `repeats` runs after one warm-up.
"""

import base64
import io
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from llmserve.errors import LLMServeError

QUESTION = "Describe this picture in detail."
TEXT_LEN = 64  # the tokens of each text chat beside the images


@dataclass(frozen=True)
class VisionBenchConfig:
    base_url: str  # the server's root (…/v1 is appended)
    model: str
    streams: tuple[int, ...] = (1, 16)
    requests_per_stream: int = 2
    output_len: int = 32
    image_side: int = 512  # the random images' width and height, in pixels
    seed: int = 0
    # text chats streaming while one-image chats run one after another (0: not measured)
    beside: int = 0
    beside_images: int = 2
    beside_alone_s: float = 10.0  # the text streams timed alone first

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


def _send_all(url: str, bodies: Iterable[dict[str, Any]],
              send: Callable[[httpx.Client, str, dict[str, Any]], Any], results: list,
              errors: list[str], lock: threading.Lock) -> None:
    """Each body sent in turn on one connection, what `send` returns appended to
    `results`; a failure is recorded in `errors` and ends the stream. A request the
    server closed the kept-alive connection on before answering (a race every HTTP
    client meets) is sent once more, on a new connection."""
    http = httpx.Client(timeout=1800)
    try:
        for body in bodies:
            try:
                try:
                    result = send(http, url, body)
                except httpx.RemoteProtocolError:
                    http.close()
                    http = httpx.Client(timeout=1800)
                    result = send(http, url, body)
            except (LLMServeError, httpx.HTTPError) as e:
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(result)
    finally:
        http.close()


def one_level(config: VisionBenchConfig, streams: int, images: list[bytes]
              ) -> dict[str, Any]:
    """`streams` concurrent streams, each sending its share of `images` one after another."""
    url = f"{config.base_url.rstrip('/')}/v1/chat/completions"
    records: list[dict[str, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def stream(index: int) -> None:
        _send_all(url, (_chat_body(config, image) for image in images[index::streams]),
                  _one_chat, records, errors, lock)

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
    report = {"config": {"base_url": config.base_url, "model": config.model,
                         "streams": list(config.streams),
                         "requests_per_stream": config.requests_per_stream,
                         "output_len": config.output_len, "image_side": config.image_side},
              "runs": runs}
    if config.beside:
        report["beside"] = beside_images(config, config.beside, [
            random_png(config.image_side, seed + 90_000 + i)
            for i in range(config.beside_images)], config.beside_alone_s)
    return report


def _text_body(config: VisionBenchConfig) -> dict[str, Any]:
    return {"model": config.model, "stream": True, "temperature": 0,
            "max_tokens": TEXT_LEN, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}


def _token_times(http: httpx.Client, url: str, body: dict[str, Any]) -> list[float]:
    """When each streamed chunk with text arrived (monotonic seconds)."""
    times = []
    with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise LLMServeError(f"{response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content"' in line and \
                    '"content":""' not in line.replace(" ", ""):
                times.append(time.monotonic())
    return times


def beside_images(config: VisionBenchConfig, text_streams: int, images: list[bytes],
                  alone_s: float = 10.0) -> dict[str, Any]:
    """`text_streams` text chats streaming back to back: for `alone_s` seconds alone, then
    while the one-image chats of `images` run one after another. Per phase, the text
    streams' gaps between tokens of a chat (p50 and the largest), the longest time no
    text stream got any text (an image encoded inside one step: every stream waits for
    it; one chat's largest gap also counts text a detokenizer holds back, a random
    model's partial characters), their tokens a second; and each image chat's TTFT."""
    url = f"{config.base_url.rstrip('/')}/v1/chat/completions"
    chats: list[list[float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def text_stream() -> None:
        def bodies() -> Iterator[dict[str, Any]]:
            while not stop.is_set():
                yield _text_body(config)

        _send_all(url, bodies(), _token_times, chats, errors, lock)

    threads = [threading.Thread(target=text_stream) for _ in range(text_streams)]
    for t in threads:
        t.start()
    time.sleep(alone_s / 2)  # every stream decoding
    alone = (time.monotonic(), time.monotonic() + alone_s)
    time.sleep(alone_s)
    ttfts = []
    beside_start = time.monotonic()
    with httpx.Client(timeout=1800) as http:
        for image in images:
            ttfts.append(_one_chat(http, url, _chat_body(config, image))["ttft_s"])
    beside = (beside_start, time.monotonic())
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise LLMServeError(f"{len(errors)} text request(s) failed: {errors[0]}")

    def phase(window: tuple[float, float]) -> dict[str, float | None]:
        gaps = [b - a for times in chats for a, b in zip(times, times[1:], strict=False)
                if window[0] <= b <= window[1]]
        every = sorted(t for times in chats for t in times if window[0] <= t <= window[1])
        silences = [b - a for a, b in zip([window[0], *every], [*every, window[1]],
                                          strict=True)]
        seconds = window[1] - window[0]
        return {"seconds": seconds, "text_tok_s": len(every) / seconds,
                "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                "gap_max_ms": 1000 * max(gaps) if gaps else None,
                "silence_max_ms": 1000 * max(silences)}

    return {"text_streams": text_streams, "images": len(images), "alone": phase(alone),
            "beside": phase(beside), "image_ttft_s": ttfts}


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
    vision = llm.engine.loaded.config.vision
    # (3, S, S), an Idefics3 image's (tiles, 3, S, S), or Qwen2.5-VL's patches and grid
    pixels, grid = prompts.processor(image), None
    if vision.merged:
        patches, grid = pixels
        pixels, tokens = patches.unsqueeze(0), grid[0] * grid[1]
    else:
        pixels = pixels.unsqueeze(0) if pixels.dim() == 3 else pixels
        tokens = vision.tokens_per_image * pixels.shape[0]
    model_ = llm.engine.loaded.model
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            model_.encode_images(pixels, grid)
            if i:
                times.append((time.perf_counter() - start) * 1000)
    return {"encode_ms": statistics.median(times), "runs_ms": times,
            "tokens_per_image": tokens,
            "tiles": 1 if vision.merged else pixels.shape[0], "tower": vision.tower,
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
    if "beside" in report:
        b = report["beside"]
        lines.append(f"{b['text_streams']} text streams, then beside {b['images']} one-image "
                     f"chats run one after another (image TTFT "
                     f"{', '.join(f'{t:.1f}' for t in b['image_ttft_s'])} s):")
        lines.append(f"  {'phase':>7} {'text tok/s':>11} {'gap p50 ms':>11} {'gap max ms':>11} "
                     f"{'no text, max ms':>16}")
        for name in ("alone", "beside"):
            p = b[name]
            lines.append(f"  {name:>7} {p['text_tok_s']:>11.2f} {p['gap_p50_ms'] or 0:>11.0f} "
                         f"{p['gap_max_ms'] or 0:>11.0f} {p['silence_max_ms']:>16.0f}")
    return "\n".join(lines)
