"""`llmserve bench vision`: one-image chats at 1 and 16 streams against a server (one it
starts on --model, or any at --base-url, llama.cpp's included), and the image encoder's
time per image in process."""

import argparse
import shlex

from llmserve.entrypoints.cli.bench_server import _measured
from llmserve.entrypoints.cli.command import Command


def cmd_bench_vision(args: argparse.Namespace) -> int:
    from llmserve.bench.vision import (
        VisionBenchConfig,
        encode_image_ms,
        format_vision_bench,
        run_vision_bench,
    )

    if (args.base_url is None) == (args.model is None):
        raise ValueError("give --model (a server is started on it) or --base-url")
    streams = tuple(int(s) for s in args.streams.split(","))

    def run() -> dict:
        encode = None
        if args.model is not None:  # timed alone, before the server starts
            encode = encode_image_ms(args.model, args.mmproj, image_side=args.image_side)
        if args.base_url is not None:
            report = run_vision_bench(VisionBenchConfig(
                args.base_url, args.served_model or "default", streams,
                args.requests_per_stream, args.output_len, args.image_side,
                beside=args.beside))
        else:
            report = _against_own_server(args, streams)
        if encode is not None:
            report["encode"] = encode
        return report

    return _measured(run, format_vision_bench, args.output_json)


def _against_own_server(args: argparse.Namespace, streams: tuple[int, ...]) -> dict:
    from llmserve.bench.soak import ServerProcess
    from llmserve.bench.vision import VisionBenchConfig, run_vision_bench

    extra = (*(("--mmproj", args.mmproj) if args.mmproj else ()),
             *shlex.split(args.server_args or ""))
    server = ServerProcess(args.model, extra)
    try:
        url = server.wait_until_serving()
        return run_vision_bench(VisionBenchConfig(
            url, server.model_name, streams, args.requests_per_stream, args.output_len,
            args.image_side, beside=args.beside))
    finally:
        server.stop()


def _arguments(vi: argparse.ArgumentParser) -> None:
    vi.add_argument("--model", help="a vision-language model to start a server on (a folder, "
                    "or a GGUF with --mmproj); its encoder is also timed in process")
    vi.add_argument("--mmproj", metavar="FILE", help="the GGUF model's projector file")
    vi.add_argument("--base-url", help="an OpenAI-compatible server already running")
    vi.add_argument("--served-model", help="the model name to send with --base-url")
    vi.add_argument("--server-args", metavar="'FLAGS'",
                    help="more flags for the started server, e.g. '--threads 2'")
    vi.add_argument("--streams", default="1,16", help="concurrent streams per level")
    vi.add_argument("--requests-per-stream", type=int, default=2)
    vi.add_argument("--output-len", type=int, default=32)
    vi.add_argument("--image-side", type=int, default=512,
                    help="the random images' side in pixels (default 512)")
    vi.add_argument("--beside", type=int, default=0, metavar="N",
                    help="then N text chats streaming while two one-image chats run: their "
                    "largest gap between tokens against their gaps alone (default 0: not run)")
    vi.add_argument("--output-json", metavar="FILE", help="write every figure as JSON")


VISION = Command("vision", help="one-image chats at 1 and 16 streams (TTFT, tok/s) and the "
                 "image encoder's time per image", add_arguments=_arguments,
                 run=cmd_bench_vision)
