"""Images side by side: llmserve and llama.cpp's llama-server on the same GGUF + projector
file, one run.

    python benchmarks/vision.py [--gguf FILE] [--tower clip-l-336|siglip-400m]
                                [--out DIR] [--streams 1,16] [--requests-per-stream 2]

The projector file is written here (random weights, F16, as llama.cpp's converter lays it
out): LLaVA-1.5's tower (CLIP ViT-L/14 at 336 px: 24 layers x 1024, 576 image tokens) or a
SigLIP-400M-shaped one (27 layers x 1152, 14 px patches at 384: 729 tokens), and the
two-layer MLP projector into the decoder's width. The decoder is --gguf (the default
model's file by default). Each server alone on the machine, 2 threads (llama.cpp with as
many slots as the widest level, continuous batching), answers `llmserve bench vision`: a
warm-up, then at each level of streams two one-image chats per stream, each image new (512
x 512 random pixels), 32 tokens out, greedy. Image encode time: llmserve's in process (the
tower and projector on one image, median of 3), llama.cpp's from its log ("encoding mtmd
batch" to "decoding image batch" at log verbosity 4, median). The machine's load is
sampled throughout (monitor.py).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from monitor import LoadMonitor, warning
from run_all import ANCHORS, DEFAULT_GGUF, THREADS, free_port, server

TOWERS = {  # name -> (layers, hidden, intermediate, heads, image side, patch, class token)
    "clip-l-336": (24, 1024, 4096, 16, 336, 14, True),
    "siglip-400m": (27, 1152, 4304, 16, 384, 14, False),
}
OUTPUT_LEN = 32


def decoder_width(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])


def write_projector(path: Path, tower: str, text_hidden: int, seed: int = 0) -> Path:
    """Random weights of `tower`'s shape in a projector file as llama.cpp's converter writes
    it (matrices F16, norms and biases F32)."""
    layers, hidden, inner, heads, side, patch, clip = TOWERS[tower]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", not clip)
    for key, value in {"image_size": side, "patch_size": patch, "embedding_length": hidden,
                       "feed_forward_length": inner, "block_count": layers,
                       "attention.head_count": heads, "projection_dim": text_hidden}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5 if clip else 1e-6)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])

    def matrix(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float16))

    def vector(name: str, size: int, value: float | None = None) -> None:
        data = np.full(size, value, np.float32) if value is not None else \
            (rng.standard_normal(size) * 0.02).astype(np.float32)
        writer.add_tensor(name, data)

    matrix("v.patch_embd.weight", hidden, 3, patch, patch)
    if not clip:
        vector("v.patch_embd.bias", hidden)
    positions = (side // patch) ** 2 + int(clip)
    matrix("v.position_embd.weight", positions, hidden)
    if clip:
        vector("v.class_embd", hidden)
        vector("v.pre_ln.weight", hidden, 1.0)
        vector("v.pre_ln.bias", hidden, 0.0)
    for i in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            matrix(f"v.blk.{i}.{name}.weight", hidden, hidden)
            vector(f"v.blk.{i}.{name}.bias", hidden)
        for name in ("ln1", "ln2"):
            vector(f"v.blk.{i}.{name}.weight", hidden, 1.0)
            vector(f"v.blk.{i}.{name}.bias", hidden, 0.0)
        matrix(f"v.blk.{i}.ffn_up.weight", inner, hidden)
        vector(f"v.blk.{i}.ffn_up.bias", inner)
        matrix(f"v.blk.{i}.ffn_down.weight", hidden, inner)
        vector(f"v.blk.{i}.ffn_down.bias", hidden)
    matrix("mm.0.weight", text_hidden, hidden)
    vector("mm.0.bias", text_hidden)
    matrix("mm.2.weight", text_hidden, text_hidden)
    vector("mm.2.bias", text_hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_STAMP = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "


def encode_times_ms(log: str) -> list[float]:
    """llama-server's image encode times: from "encoding mtmd batch" to the "decoding image
    batch" that follows (the tower and projector; the decode after it is the decoder's
    prefill of the image's tokens). Its images are encoded one at a time."""
    def ms(match: re.Match) -> float:
        minutes, seconds, millis, micros = (int(g) for g in match.groups()[:4])
        return (minutes * 60 + seconds) * 1000 + millis + micros / 1000

    times, start = [], None
    for match in re.finditer(_STAMP + r".*?(encoding mtmd batch|decoding image batch)", log):
        if match.group(5) == "encoding mtmd batch":
            start = ms(match)
        elif start is not None:
            times.append(ms(match) - start)
            start = None
    return times


def bench_cli(args: list[str], out: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "vision", *args,
           "--output-json", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--tower", choices=sorted(TOWERS), default="clip-l-336")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/vision")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=ANCHORS / "bin/llama-server")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    projector = args.out / f"mmproj-{args.tower}-{args.gguf.stem}.gguf"
    if not projector.exists():
        write_projector(projector, args.tower, decoder_width(args.gguf))
    widest = max(int(s) for s in args.streams.split(","))
    common = ["--streams", args.streams, "--requests-per-stream",
              str(args.requests_per_stream), "--output-len", str(OUTPUT_LEN)]
    results: dict = {"gguf": str(args.gguf), "tower": args.tower, "projector": str(projector)}
    with LoadMonitor() as monitor:
        results["llmserve"] = bench_cli(
            ["--model", str(args.gguf), "--mmproj", str(projector),
             "--server-args", f"--threads {THREADS} --max-num-seqs {widest}", *common],
            args.out / f"llmserve-{args.tower}.json")
    results["llmserve"]["load"] = monitor.summary()
    port = free_port()
    tokens = TOWERS[args.tower]
    per_slot = (tokens[4] // tokens[5]) ** 2 + 1 + 128 + OUTPUT_LEN
    log = args.out / f"llama.cpp-{args.tower}.log"
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--mmproj", str(projector),
           "--port", str(port), "-t", str(THREADS), "-tb", str(THREADS), "-np", str(widest),
           "-cb", "-c", str(widest * per_slot), "--no-mmproj-offload", "-a", "llava",
           "-lv", "4"]  # its image encode and image-token decode times in the log
    env = {"LD_LIBRARY_PATH": str(args.llama_server.parent)}
    with LoadMonitor() as monitor, server(cmd, port, log, monitor, env) as info:
        results["llama.cpp"] = bench_cli(
            ["--base-url", f"http://127.0.0.1:{port}", "--served-model", "llava", *common],
            args.out / f"llama.cpp-{args.tower}.json")
    results["llama.cpp"]["load"] = monitor.summary()
    results["llama.cpp"]["server"] = info
    encoded = encode_times_ms(log.read_text())
    results["llama.cpp"]["encode_ms"] = statistics.median(encoded) if encoded else None
    results["llama.cpp"]["encode_runs_ms"] = encoded
    (args.out / f"summary-{args.tower}.json").write_text(json.dumps(results, indent=1))
    print(summary_table(results))
    for name in ("llmserve", "llama.cpp"):
        if (line := warning(name, results[name]["load"])) is not None:
            print(line)
    return 0


def summary_table(results: dict) -> str:
    ours, peer = results["llmserve"], results["llama.cpp"]
    lines = [f"tower {results['tower']}, decoder {Path(results['gguf']).name}",
             f"{'measure':<28}{'llmserve':>10}{'llama.cpp':>11}{'ratio':>8}"]
    encode = ours["encode"]["encode_ms"], peer["encode_ms"]
    lines.append(_row("image encode, ms per image", *encode, lower_is_better=True))
    for a, b in zip(ours["runs"], peer["runs"], strict=True):
        s = a["streams"]
        lines.append(_row(f"TTFT p50 s, {s} stream(s)", a["ttft_p50_s"], b["ttft_p50_s"],
                          lower_is_better=True))
        lines.append(_row(f"output tok/s, {s} stream(s)", a["tok_s"], b["tok_s"]))
    lines.append("ratio: llmserve / llama.cpp (times: below 1 is faster; tok/s: above 1)")
    return "\n".join(lines)


def _row(label: str, ours: float | None, peer: float | None,
         lower_is_better: bool = False) -> str:
    ratio = "-" if not ours or not peer else f"{ours / peer:.2f}x"
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    return f"{label:<28}{fmt(ours):>10}{fmt(peer):>11}{ratio:>8}"


if __name__ == "__main__":
    sys.exit(main())
