"""Images side by side: llmserve and llama.cpp's llama-server on the same GGUF + projector
file, one run.

    python benchmarks/vision.py [--family llava|gemma3|smolvlm|qwen2.5vl|qwen3vl]
                                [--gguf FILE]
                                [--tower clip-l-336|siglip-400m] [--out DIR]
                                [--streams 1,16] [--requests-per-stream 2]

The projector file is written here (random weights, F16, as llama.cpp's converter lays it
out). `--family llava` (the default): LLaVA-1.5's tower (CLIP ViT-L/14 at 336 px: 24 layers
x 1024, 576 image tokens) or a SigLIP-400M-shaped one (27 layers x 1152, 14 px patches at
384: 729 tokens), and the two-layer MLP projector into the width of --gguf (the default
model's file by default). `--family gemma3`: Gemma 3's tower (SigLIP-400M's shape at 896
px: 4096 patches pooled 4 x 4 to 256 tokens) and projector before the catalog's gemma3-270m
decoder; `--family smolvlm`: SmolVLM-256M's tower (SigLIP-base's shape, 12 layers x 768 at
512 px, 16 px patches, pixel-shuffled 4 x 4 to 64 tokens a tile; an image resized to 2048
px on its longest edge: 4 x 4 tiles and the whole image, 1088 tokens) before the catalog's
smollm2-135m decoder (SmolVLM-256M's own decoder shape); `--family qwen2.5vl`:
Qwen2.5-VL-3B's and 7B's ViT (32 layers x 1280, 14 px patches merged 2 x 2, windows of 112
px, four layers over the whole image; a 512 px image resized to 504: 324 tokens) before a
Qwen2.5-0.5B-shaped random decoder (`benchmarks/shapes.py`, Q8_0) as llama.cpp's `qwen2vl`
architecture (M-RoPE sections 8, 12, 12 of its 64-wide heads); `--family qwen3vl`:
Qwen3-VL-4B's and 8B's ViT (27 layers x 1152, 16 px patches merged 2 x 2, learned
positions on a 48 x 48 grid, DeepStack from layers 8, 16 and 24; a 512 px image: 256
tokens) before a Qwen3-0.6B-shaped random decoder (Q8_0) as llama.cpp's `qwen3vl`
(interleaved M-RoPE sections 24, 20, 20, three DeepStack layers). Those decoders' vocabularies
lack the image tokens, so the decoder file is the catalog's (or the shape's) with them
added (their embedding rows appended), as the families' GGUF files hold them, and the
family's chat template. Each server alone on the machine, 2 threads (llama.cpp with as many
slots as the widest level, continuous batching), answers `llmserve bench vision`: a
warm-up, then at each level of streams two one-image chats per stream, each image new (512
x 512 random pixels), 32 tokens out, greedy. Image encode time: llmserve's in process (the
tower and projector on one image, median of 3), llama.cpp's from its log ("encoding mtmd
batch" to "decoding image batch" at log verbosity 4, median; it encodes a SmolVLM image
tile by tile, so its median tile's time times the tiles an image takes). The machine's load
is sampled throughout (monitor.py).
"""

import argparse
import functools
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny_models.py
from tests.tiny_models import QWEN2_5_VL_TEMPLATE  # noqa: E402

TOWERS = {  # name -> (layers, hidden, intermediate, heads, image side, patch, class token)
    "clip-l-336": (24, 1024, 4096, 16, 336, 14, True),
    "siglip-400m": (27, 1152, 4304, 16, 384, 14, False),
    "siglip-400m-896": (27, 1152, 4304, 16, 896, 14, False),  # Gemma 3's
    "siglip-base-512": (12, 768, 3072, 12, 512, 16, False),  # SmolVLM-256M's
    "qwen2.5-vl-vit": (32, 1280, 3420, 16, 504, 28, False),  # its side in merged patches
    "qwen3-vl-vit": (27, 1152, 4304, 16, 512, 32, False),
}
QWEN_PATCH, QWEN_WINDOW_PATTERN = 14, 8  # layers 7, 15, 23, 31 over the whole image
QWEN_MROPE = [8, 12, 12, 0]
QWEN3_PATCH, QWEN3_POSITIONS, QWEN3_DEEPSTACK = 16, 48 * 48, (8, 16, 24)
QWEN3_MROPE = [24, 20, 20, 0]
# family -> (projector type, tower, catalog decoder, tokens added to its vocabulary,
# image tokens a 512 px image takes, chat template)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")
FAMILIES = {
    "gemma3": ("gemma3", "siglip-400m-896", "gemma3-270m", ["<image_soft_token>"], 256 + 8,
               GEMMA3_TEMPLATE),
    "smolvlm": ("idefics3", "siglip-base-512", "smollm2-135m",
                ["<image>", "<fake_token_around_image>", "<global-img>",
                 "<end_of_utterance>"], 17 * 64 + 64, SMOLVLM_TEMPLATE),
}
FAMILIES["qwen2.5vl"] = ("qwen2.5vl", "qwen2.5-vl-vit", "shape:qwen2.5-0.5b",
                         ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"], 324 + 2,
                         QWEN2_5_VL_TEMPLATE)
FAMILIES["qwen3vl"] = ("qwen3vl", "qwen3-vl-vit", "shape:qwen3-0.6b",
                       ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"], 256 + 2,
                       QWEN2_5_VL_TEMPLATE)
# a shape decoder as its family's llama.cpp architecture: (architecture, its keys)
DECODER_ARCHS = {
    "qwen2.5vl": ("qwen2vl", {"qwen2vl.rope.dimension_sections": QWEN_MROPE}),
    "qwen3vl": ("qwen3vl", {"qwen3vl.rope.dimension_sections": QWEN3_MROPE,
                            "qwen3vl.n_deepstack_layers": len(QWEN3_DEEPSTACK)}),
}
SMOLVLM_SCALE, SMOLVLM_EDGE = 4, 2048
OUTPUT_LEN = 32


def decoder_width(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])


class RandomTensors:
    """A projector file's random tensors: matrices (std 0.02, F16 unless told) and vectors
    (std 0.02, or a constant: a norm's ones), F32."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self.writer, self.rng = writer, np.random.default_rng(seed)

    def attention(self, layer: int, hidden: int) -> None:
        """A tower layer's q, k, v and output projections, each with its bias."""
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            self.matrix(f"v.blk.{layer}.{name}.weight", hidden, hidden)
            self.vector(f"v.blk.{layer}.{name}.bias", hidden)

    def matrix(self, name: str, *shape: int, dtype: type = np.float16) -> None:
        self.writer.add_tensor(name, (self.rng.standard_normal(shape) * 0.02).astype(dtype))

    def vector(self, name: str, size: int, value: float | None = None) -> None:
        data = np.full(size, value, np.float32) if value is not None else \
            (self.rng.standard_normal(size) * 0.02).astype(np.float32)
        self.writer.add_tensor(name, data)

    @staticmethod
    def finish(writer: gguf.GGUFWriter, path: Path) -> Path:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def write_projector(path: Path, tower: str, text_hidden: int, seed: int = 0,
                    kind: str = "mlp") -> Path:
    """Random weights of `tower`'s shape in a projector file as llama.cpp's converter writes
    it (matrices F16, norms and biases F32), with LLaVA's MLP (`kind` "mlp"), Gemma 3's
    projection ("gemma3") or SmolVLM's pixel-shuffle one ("idefics3")."""
    if kind == "qwen2.5vl":
        return write_qwen_projector(path, tower, text_hidden, seed)
    if kind == "qwen3vl":
        return write_qwen3_projector(path, tower, text_hidden, seed)
    layers, hidden, inner, heads, side, patch, clip = TOWERS[tower]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", kind == "mlp")
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.use_gelu", not clip)
    if kind == "idefics3":
        writer.add_uint32("clip.vision.projector.scale_factor", SMOLVLM_SCALE)
        writer.add_uint32("clip.vision.preproc_image_size", SMOLVLM_EDGE)
    for key, value in {"image_size": side, "patch_size": patch, "embedding_length": hidden,
                       "feed_forward_length": inner, "block_count": layers,
                       "attention.head_count": heads, "projection_dim": text_hidden}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5 if clip else 1e-6)
    if kind == "mlp":
        writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    else:
        writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    tensors = RandomTensors(writer, seed)
    matrix, vector = tensors.matrix, tensors.vector
    # the embeddings: F16 for LLaVA, F32 for Gemma 3 and SmolVLM, as the converter writes
    # them (llama.cpp's graphs for those add the position table to F32 rows directly)
    embedding = matrix if kind == "mlp" else functools.partial(matrix, dtype=np.float32)
    embedding("v.patch_embd.weight", hidden, 3, patch, patch)
    if not clip:
        vector("v.patch_embd.bias", hidden)
    positions = (side // patch) ** 2 + int(clip)
    embedding("v.position_embd.weight", positions, hidden)
    if clip:
        vector("v.class_embd", hidden)
        vector("v.pre_ln.weight", hidden, 1.0)
        vector("v.pre_ln.bias", hidden, 0.0)
    for i in range(layers):
        tensors.attention(i, hidden)
        for name in ("ln1", "ln2"):
            vector(f"v.blk.{i}.{name}.weight", hidden, 1.0)
            vector(f"v.blk.{i}.{name}.bias", hidden, 0.0)
        matrix(f"v.blk.{i}.ffn_up.weight", inner, hidden)
        vector(f"v.blk.{i}.ffn_up.bias", inner)
        matrix(f"v.blk.{i}.ffn_down.weight", hidden, inner)
        vector(f"v.blk.{i}.ffn_down.bias", hidden)
    if kind != "mlp":  # the normed output is the features
        vector("v.post_ln.weight", hidden, 1.0)
        vector("v.post_ln.bias", hidden, 0.0)
    if kind == "gemma3":
        matrix("mm.input_projection.weight", hidden, text_hidden)  # used as x @ W
        vector("mm.soft_emb_norm.weight", hidden, 1.0)  # stored as 1 + weight
    elif kind == "idefics3":
        matrix("mm.model.fc.weight", text_hidden, hidden * SMOLVLM_SCALE ** 2)
    else:
        matrix("mm.0.weight", text_hidden, hidden)
        vector("mm.0.bias", text_hidden)
        matrix("mm.2.weight", text_hidden, text_hidden)
        vector("mm.2.bias", text_hidden)
    return RandomTensors.finish(writer, path)


def write_qwen_projector(path: Path, tower: str, text_hidden: int, seed: int = 0) -> Path:
    """Random weights of Qwen2.5-VL's ViT and merger as llama.cpp's converter writes its
    projector file (the Conv3d as two 2-D kernels, q/k/v split, RMSNorms, gated MLPs)."""
    layers, hidden, inner, heads, _, _, _ = TOWERS[tower]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen2.5vl_merger")
    writer.add_bool("clip.use_silu", True)
    for key, value in {"image_size": 560, "patch_size": QWEN_PATCH,
                       "embedding_length": hidden, "feed_forward_length": inner,
                       "block_count": layers, "attention.head_count": heads,
                       "projection_dim": text_hidden,
                       "n_wa_pattern": QWEN_WINDOW_PATTERN}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])

    tensors = RandomTensors(writer, seed)
    matrix, vector = tensors.matrix, tensors.vector
    matrix("v.patch_embd.weight", hidden, 3, QWEN_PATCH, QWEN_PATCH)
    matrix("v.patch_embd.weight.1", hidden, 3, QWEN_PATCH, QWEN_PATCH)
    for i in range(layers):
        tensors.attention(i, hidden)
        for name in ("ln1", "ln2"):
            vector(f"v.blk.{i}.{name}.weight", hidden, 1.0)
        for name in ("ffn_gate", "ffn_up"):
            matrix(f"v.blk.{i}.{name}.weight", inner, hidden)
            vector(f"v.blk.{i}.{name}.bias", inner)
        matrix(f"v.blk.{i}.ffn_down.weight", hidden, inner)
        vector(f"v.blk.{i}.ffn_down.bias", hidden)
    wide = 4 * hidden
    vector("v.post_ln.weight", hidden, 1.0)
    matrix("mm.0.weight", wide, wide)
    vector("mm.0.bias", wide)
    matrix("mm.2.weight", text_hidden, wide)
    vector("mm.2.bias", text_hidden)
    return RandomTensors.finish(writer, path)


def write_qwen3_projector(path: Path, tower: str, text_hidden: int, seed: int = 0) -> Path:
    """Random weights of Qwen3-VL's ViT, merger and DeepStack mergers as llama.cpp's
    converter writes its projector file (the Conv3d as two 2-D kernels and its bias,
    learned positions, q/k/v fused, LayerNorms, GELU MLPs)."""
    layers, hidden, inner, heads, _, _, _ = TOWERS[tower]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen3vl_merger")
    writer.add_bool("clip.use_gelu", True)
    side = int(QWEN3_POSITIONS ** 0.5)
    for key, value in {"image_size": side * QWEN3_PATCH, "patch_size": QWEN3_PATCH,
                       "embedding_length": hidden, "feed_forward_length": inner,
                       "block_count": layers, "attention.head_count": heads,
                       "projection_dim": text_hidden, "spatial_merge_size": 2}.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.is_deepstack_layers",
                     [i in QWEN3_DEEPSTACK for i in range(layers)])

    tensors = RandomTensors(writer, seed)
    matrix, vector = tensors.matrix, tensors.vector
    matrix("v.patch_embd.weight", hidden, 3, QWEN3_PATCH, QWEN3_PATCH)
    matrix("v.patch_embd.weight.1", hidden, 3, QWEN3_PATCH, QWEN3_PATCH)
    vector("v.patch_embd.bias", hidden)
    matrix("v.position_embd.weight", QWEN3_POSITIONS, hidden, dtype=np.float32)
    wide = 4 * hidden

    def merger(prefix: str, fc1: str, fc2: str, norm_width: int) -> None:
        vector(f"{prefix}norm.weight" if prefix else "v.post_ln.weight", norm_width, 1.0)
        vector(f"{prefix}norm.bias" if prefix else "v.post_ln.bias", norm_width, 0.0)
        matrix(f"{fc1}.weight", wide, wide)
        vector(f"{fc1}.bias", wide)
        matrix(f"{fc2}.weight", text_hidden, wide)
        vector(f"{fc2}.bias", text_hidden)

    for i in range(layers):
        matrix(f"v.blk.{i}.attn_qkv.weight", 3 * hidden, hidden)
        vector(f"v.blk.{i}.attn_qkv.bias", 3 * hidden)
        matrix(f"v.blk.{i}.attn_out.weight", hidden, hidden)
        vector(f"v.blk.{i}.attn_out.bias", hidden)
        for name in ("ln1", "ln2"):
            vector(f"v.blk.{i}.{name}.weight", hidden, 1.0)
            vector(f"v.blk.{i}.{name}.bias", hidden, 0.0)
        matrix(f"v.blk.{i}.ffn_up.weight", inner, hidden)
        vector(f"v.blk.{i}.ffn_up.bias", inner)
        matrix(f"v.blk.{i}.ffn_down.weight", hidden, inner)
        vector(f"v.blk.{i}.ffn_down.bias", hidden)
        if i in QWEN3_DEEPSTACK:
            merger(f"v.deepstack.{i}.", f"v.deepstack.{i}.fc1", f"v.deepstack.{i}.fc2", wide)
    merger("", "mm.0", "mm.2", hidden)
    return RandomTensors.finish(writer, path)


def with_image_tokens(source: Path, out: Path, tokens: list[str], template: str,
                      seed: int = 0, arch: str | None = None,
                      extra_keys: dict | None = None) -> Path:
    """`source` (a GGUF decoder) with `tokens` added to its vocabulary as control tokens,
    their embedding rows appended (random, in the embedding's own type), and
    `template` as its chat template; every other tensor and key as it was (`arch`: the
    file as another architecture, its keys renamed; `extra_keys`: more metadata)."""
    reader = gguf.GGUFReader(str(source))
    own = reader.fields["general.architecture"].contents()
    arch = arch or own
    writer = gguf.GGUFWriter(str(out), arch)
    extra = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3] * len(tokens),
             "tokenizer.ggml.scores": [0.0] * len(tokens)}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture",
                                                 "tokenizer.chat_template"):
            continue
        value = field.contents()
        if name in extra:
            value = value + extra[name]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if name.startswith(f"{own}."):
            name = arch + name[len(own):]
        if name == f"{arch}.vocab_size":  # the embedding's rows, the tokens appended
            value += len(tokens)
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    writer.add_string("tokenizer.chat_template", template)
    for name, value in (extra_keys or {}).items():
        if isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_array(name, value)
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "token_embd.weight":
            rows = (rng.standard_normal((len(tokens), int(tensor.shape[0]))) * 0.02)
            added = rows.astype(np.float32)
            if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                          gguf.GGMLQuantizationType.F16):
                added = gguf.quants.quantize(added, tensor.tensor_type)
            data = np.concatenate([data, added.astype(data.dtype)])
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
    parser.add_argument("--family", choices=["llava", *FAMILIES], default="llava")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the decoder (llava only; default: the default model's file)")
    parser.add_argument("--tower", choices=sorted(TOWERS), default="clip-l-336")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results/vision")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=ANCHORS / "bin/llama-server")
    parser.add_argument("--beside", type=int, default=4,
                        help="text streams timed beside image chats (0: not measured)")
    parser.add_argument("--only", choices=["llmserve", "llama.cpp"], default=None,
                        help="run one server; the other's results are read from --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kind, per_image = "mlp", None
    if args.family != "llava":
        from llmserve.loader.catalog import fetch_model

        kind, args.tower, decoder, tokens, per_image, template = FAMILIES[args.family]
        args.gguf = args.out / f"{args.family}-{decoder.removeprefix('shape:')}.gguf"
        if not args.gguf.exists() and decoder.startswith("shape:"):  # the Qwen-VLs'
            from shapes import shape_gguf

            arch, keys = DECODER_ARCHS[args.family]
            with_image_tokens(shape_gguf(decoder.removeprefix("shape:"), "Q8_0"), args.gguf,
                              tokens, template, arch=arch, extra_keys=keys)
        elif not args.gguf.exists():
            with_image_tokens(fetch_model(decoder), args.gguf, tokens, template)
    args.gguf = args.gguf or DEFAULT_GGUF
    projector = args.out / f"mmproj-{args.tower}-{args.gguf.stem}.gguf"
    if not projector.exists():
        write_projector(projector, args.tower, decoder_width(args.gguf), kind=kind)
    # seats for the widest level, and for the text streams beside an image chat
    widest = max(*(int(s) for s in args.streams.split(",")), args.beside + 1)
    common = ["--streams", args.streams, "--requests-per-stream",
              str(args.requests_per_stream), "--output-len", str(OUTPUT_LEN),
              "--beside", str(args.beside)]
    results: dict = {"gguf": str(args.gguf), "tower": args.tower, "projector": str(projector),
                     "family": args.family}
    ours = args.out / f"llmserve-{args.tower}.json"
    if args.only == "llama.cpp":
        results["llmserve"] = json.loads(ours.read_text())
    else:
        with LoadMonitor() as monitor:
            results["llmserve"] = bench_cli(
                ["--model", str(args.gguf), "--mmproj", str(projector),
                 "--server-args", f"--threads {THREADS} --max-num-seqs {widest}", *common],
                ours)
        results["llmserve"]["load"] = monitor.summary()
        ours.write_text(json.dumps(results["llmserve"], indent=1))
    if args.only == "llmserve":
        print(json.dumps(results["llmserve"]["load"]))
        return 0
    port = free_port()
    tokens = TOWERS[args.tower]
    per_slot = (per_image or (tokens[4] // tokens[5]) ** 2 + 1) + 128 + OUTPUT_LEN
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
    # one encode per tile (SmolVLM: an image is 17): per image, the median tile's time
    # times the tiles an image takes (its encodes over the images sent, warm-up and the
    # images beside the text streams included)
    images = 1 + sum(run["requests"] for run in results["llama.cpp"]["runs"]) + \
        results["llama.cpp"].get("beside", {}).get("images", 0)
    per_image = max(1, round(len(encoded) / images))
    results["llama.cpp"]["encode_ms"] = statistics.median(encoded) * per_image \
        if encoded else None
    results["llama.cpp"]["encode_runs_ms"] = encoded
    results["llama.cpp"]["encodes_per_image"] = per_image
    (args.out / f"summary-{args.tower}.json").write_text(json.dumps(results, indent=1))
    print(summary_table(results))
    for name in ("llmserve", "llama.cpp"):
        if (line := warning(name, results[name]["load"])) is not None:
            print(line)
    return 0


def summary_table(results: dict) -> str:
    ours, peer = results["llmserve"], results["llama.cpp"]
    lines = [f"tower {results['tower']}, decoder {Path(results['gguf']).name}",
             f"{'measure':<44}{'llmserve':>10}{'llama.cpp':>11}{'ratio':>8}"]
    encode = ours["encode"]["encode_ms"], peer["encode_ms"]
    lines.append(_row("image encode, ms per image", *encode, lower_is_better=True))
    for a, b in zip(ours["runs"], peer["runs"], strict=True):
        s = a["streams"]
        lines.append(_row(f"TTFT p50 s, {s} stream(s)", a["ttft_p50_s"], b["ttft_p50_s"],
                          lower_is_better=True))
        lines.append(_row(f"output tok/s, {s} stream(s)", a["tok_s"], b["tok_s"]))
    if "beside" in ours:
        n = ours["beside"]["text_streams"]
        for phase in ("alone", "beside"):
            lines.append(_row(f"{n} text streams {phase} images: no text, max ms",
                              ours["beside"][phase]["silence_max_ms"],
                              peer["beside"][phase]["silence_max_ms"], lower_is_better=True))
            lines.append(_row(f"{n} text streams {phase} images: gap p50 ms",
                              ours["beside"][phase]["gap_p50_ms"],
                              peer["beside"][phase]["gap_p50_ms"], lower_is_better=True))
            lines.append(_row(f"{n} text streams {phase} images: tok/s",
                              ours["beside"][phase]["text_tok_s"],
                              peer["beside"][phase]["text_tok_s"]))
    lines.append("ratio: llmserve / llama.cpp (times: below 1 is faster; tok/s: above 1)")
    return "\n".join(lines)


def _row(label: str, ours: float | None, peer: float | None,
         lower_is_better: bool = False) -> str:
    ratio = "-" if not ours or not peer else f"{ours / peer:.2f}x"
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    return f"{label:<44}{fmt(ours):>10}{fmt(peer):>11}{ratio:>8}"


if __name__ == "__main__":
    sys.exit(main())
