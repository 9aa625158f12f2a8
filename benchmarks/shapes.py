"""Random-weight GGUF files in the published shapes of 1-8B models, so that benchmarks run
at the sizes users run (the default model is 135M).

    python benchmarks/shapes.py SHAPE QTYPE   # write the file once; print its path
    python benchmarks/shapes.py --list        # the shapes and their parameter counts

Every byte of work is real, the tokens mean nothing: weights are random normal (std 0.02,
norms 1), the tokenizer is SmolLM2's (its BPE vocabulary, merges and chat template, from
the default model's GGUF) padded with `<|reserved_N|>` tokens up to the shape's
vocabulary, so the embedding and the LM head have their real size. Tensor names, layout
and metadata are what llama.cpp's converter (convert_hf_to_gguf.py) writes, so llama.cpp
and llmserve both load the files; Llama shapes carry their Llama 3 rope scaling as the
converter does, a `rope_freqs` tensor.

F16, Q8_0 and Q4_0 are written here, straight from numpy one tensor at a time (an 8B model
never sits in memory whole): every 2-D weight in that type, norms and biases in F32. Any
other type (Q4_K_M, Q5_K_M, Q6_K, ...) is the F16 file through llama.cpp's `llama-quantize`,
which picks each tensor's type as it does for real models; the F16 file stays cached as the
source of every such type. Files live in ~/.cache/llmserve/bench-shapes/<shape>.<TYPE>.gguf.
"""

import argparse
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/gguf_writer.py
CACHE = Path.home() / ".cache/llmserve/bench-shapes"
LLAMA_BIN = Path.home() / ".cache/llmserve-anchors/bin"
WRITTEN_TYPES = ("F16", "Q8_0", "Q4_0")  # written here; any other goes through llama-quantize
WEIGHT_STD = 0.02
SEED = 0
CHUNK_ELEMENTS = 1 << 24  # rows drawn and quantized at a time (64 MiB of float32)
# Padding tokens are NORMAL, not UNUSED as the converter's padding: random weights emit
# them (most of a Llama vocabulary is padding here), and both engines then stream the same
# text for them ("<|reserved_7|>"), where llama.cpp would stream nothing for an UNUSED one.
# No merge reaches them and they are not matched in text (USER_DEFINED tokens would be, and
# llama.cpp's tokenizer scans every such token for each prompt).
TOKEN_TYPE_NORMAL = 1


@dataclass(frozen=True)
class Shape:
    """One model's published config (its Hugging Face config.json), as GGUF needs it."""

    arch: str  # GGUF general.architecture: llama, qwen2, qwen3
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    llama3_rope_factor: float | None = None  # Llama 3.1/3.2 rope scaling
    # a mixture of experts (Qwen3-MoE) in every layer: its experts, those a token runs,
    # and each expert's width (0: a dense MLP of intermediate_size)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not share {self.num_kv_heads} KV heads")

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in tensors(self))

    @property
    def active_params(self) -> int:
        """Parameters a token runs (all but the unchosen experts)."""
        if not self.experts:
            return self.num_params
        idle = self.experts - self.experts_per_token
        return self.num_params - self.num_layers * idle * 3 * self.hidden_size * \
            self.expert_intermediate


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5,
                          131072, llama3_rope_factor=32.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, 1e-5,
                          131072, llama3_rope_factor=32.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 1e-5,
                          131072, llama3_rope_factor=8.0),
    # Qwen2.5-0.5B: the decoder of the Qwen2.5-VL image benchmark (`benchmarks/vision.py`)
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 151936, True, 1000000.0, 1e-6,
                          32768, qkv_bias=True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, 1000000.0, 1e-6,
                          32768, qkv_bias=True),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 128, 11008, 151936, True, 1000000.0, 1e-6,
                        32768, qkv_bias=True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 1000000.0, 1e-6,
                        32768, qkv_bias=True),
    # Qwen3-0.6B: the decoder of the Qwen3-VL image benchmark (`benchmarks/vision.py`)
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1000000.0, 1e-6,
                        40960, qk_norm=True),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1000000.0, 1e-6,
                        40960, qk_norm=True),
    # Qwen3-30B-A3B: 128 experts of 768, 8 a token; whole (17 GB at Q4_0), and its first 12
    # of 48 layers (every layer as the real model's, a quarter of them: 4.4 GB at Q4_0)
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, False, 1000000.0,
                           1e-6, 40960, qk_norm=True, experts=128, experts_per_token=8,
                           expert_intermediate=768),
    "qwen3-30b-a3b-12l": Shape("qwen3moe", 2048, 12, 32, 4, 128, 6144, 151936, False,
                               1000000.0, 1e-6, 40960, qk_norm=True, experts=128,
                               experts_per_token=8, expert_intermediate=768),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str  # llama.cpp's name
    shape: tuple[int, ...]  # numpy order: (rows, columns); GGUF lists it reversed
    kind: str  # "weight" (random, in the file's type), "bias" and "router" (random, F32),
    # "norm" (ones, F32)


def tensors(shape: Shape) -> Iterator[TensorSpec]:
    """The file's tensors in the converter's names; a Llama model's Q/K rows are permuted
    by the converter, which leaves random rows random."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    yield TensorSpec("token_embd.weight", (shape.vocab_size, h), "weight")
    for i in range(shape.num_layers):
        blk = f"blk.{i}."
        yield TensorSpec(blk + "attn_norm.weight", (h,), "norm")
        for proj, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield TensorSpec(blk + proj + ".weight", (rows, h), "weight")
            if shape.qkv_bias:
                yield TensorSpec(blk + proj + ".bias", (rows,), "bias")
        if shape.qk_norm:
            yield TensorSpec(blk + "attn_q_norm.weight", (shape.head_dim,), "norm")
            yield TensorSpec(blk + "attn_k_norm.weight", (shape.head_dim,), "norm")
        yield TensorSpec(blk + "attn_output.weight", (h, q), "weight")
        yield TensorSpec(blk + "ffn_norm.weight", (h,), "norm")
        if shape.experts:  # the router, then each projection's experts as one 3-D tensor
            e, width = shape.experts, shape.expert_intermediate
            yield TensorSpec(blk + "ffn_gate_inp.weight", (e, h), "router")
            yield TensorSpec(blk + "ffn_gate_exps.weight", (e, width, h), "weight")
            yield TensorSpec(blk + "ffn_up_exps.weight", (e, width, h), "weight")
            yield TensorSpec(blk + "ffn_down_exps.weight", (e, h, width), "weight")
            continue
        yield TensorSpec(blk + "ffn_gate.weight", (shape.intermediate_size, h), "weight")
        yield TensorSpec(blk + "ffn_up.weight", (shape.intermediate_size, h), "weight")
        yield TensorSpec(blk + "ffn_down.weight", (h, shape.intermediate_size), "weight")
    yield TensorSpec("output_norm.weight", (h,), "norm")
    if not shape.tied_embeddings:
        yield TensorSpec("output.weight", (shape.vocab_size, h), "weight")


def shape_gguf(name: str, qtype: str, cache: Path = CACHE, llama_bin: Path = LLAMA_BIN) -> Path:
    """The GGUF file of shape `name` in `qtype` (F16, Q8_0, Q4_0 or any llama-quantize
    type), written on first use and found in `cache` afterwards."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    if not re.fullmatch(r"[A-Z0-9_]+", qtype):
        raise ValueError(f"--qtype {qtype!r}: a GGUF type name such as Q4_K_M, Q8_0 or F16")
    path = cache / f"{name}.{qtype}.gguf"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # never cached half-written
    if qtype in WRITTEN_TYPES:
        print(f"writing {path}", file=sys.stderr, flush=True)
        write_gguf(SHAPES[name], name, qtype, partial)
    else:
        source = shape_gguf(name, "F16", cache, llama_bin)
        quantize(source, partial, qtype, llama_bin)
    partial.rename(path)
    return path


def quantize(source: Path, out: Path, qtype: str, llama_bin: Path) -> None:
    tool = llama_bin / "llama-quantize"
    if not tool.is_file():
        raise FileNotFoundError(f"no llama-quantize at {tool}: build llama.cpp with "
                                "tools/build_llama_server.sh, or write F16, Q8_0 or Q4_0")
    cmd = [str(tool), str(source), str(out), qtype, str(os.cpu_count() or 1)]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env={**os.environ, "LD_LIBRARY_PATH": str(llama_bin)},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")


def write_gguf(shape: Shape, name: str, qtype: str, path: Path) -> None:
    """Header and tensor infos first, then each tensor's bytes, made as they are written."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), shape.arch)
    write_metadata(writer, shape, name, qtype)
    specs = list(tensors(shape))
    rope_freqs = llama3_rope_freqs(shape) if shape.llama3_rope_factor else None
    if rope_freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", rope_freqs.shape, rope_freqs.dtype,
                               rope_freqs.nbytes)
    for spec in specs:
        stored = qt if spec.kind == "weight" else gguf.GGMLQuantizationType.F32
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32),
                               _nbytes(spec.shape, stored), raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if rope_freqs is not None:
        writer.write_tensor_data(rope_freqs)
    rng = np.random.default_rng(SEED)
    for spec in specs:
        writer.write_tensor_data(_tensor_bytes(spec, qt, rng))
    writer.close()


def _nbytes(shape: tuple[int, ...], qt: Any) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qt]
    return math.prod(shape) // block * size


def _tensor_bytes(spec: TensorSpec, qt: Any, rng: np.random.Generator) -> np.ndarray:
    """The tensor as stored: a weight drawn and converted CHUNK_ELEMENTS at a time."""
    import gguf

    if spec.kind == "norm":
        return np.ones(spec.shape, np.float32)
    if spec.kind in ("bias", "router"):
        return rng.standard_normal(spec.shape, np.float32) * np.float32(WEIGHT_STD)
    cols = spec.shape[-1]
    rows = math.prod(spec.shape[:-1])  # a 3-D tensor's experts: their rows one after another
    step = max(1, CHUNK_ELEMENTS // cols)
    parts = []
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), cols), np.float32)
        chunk *= np.float32(WEIGHT_STD)
        parts.append(gguf.quants.quantize(chunk, qt))  # (rows, cols) F16, or (rows, bytes)
    return np.concatenate(parts).reshape(*spec.shape[:-1], -1)


def write_metadata(writer: Any, shape: Shape, name: str, qtype: str) -> None:
    """The keys convert_hf_to_gguf.py writes for these architectures, and the tokenizer."""
    import gguf

    from tests.gguf_writer import add_metadata

    writer.add_type("model")
    writer.add_name(f"{name} (random weights)")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_per_token)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in padded_tokenizer(shape.vocab_size).items():
        add_metadata(writer, key, value)


def padded_tokenizer(vocab_size: int) -> dict[str, Any]:
    """SmolLM2's `tokenizer.*` metadata with padding tokens up to `vocab_size`."""
    from llmserve.gguf_meta import open_gguf, read_metadata
    from llmserve.loader.catalog import fetch_model

    meta = read_metadata(open_gguf(fetch_model("smollm2-135m")))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    tokens = tokenizer["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_size:
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold SmolLM2's {len(tokens)}")
    pad = range(vocab_size - len(tokens))
    tokenizer["tokenizer.ggml.tokens"] = tokens + [f"<|reserved_{i}|>" for i in pad]
    tokenizer["tokenizer.ggml.token_type"] = (tokenizer["tokenizer.ggml.token_type"]
                                              + [TOKEN_TYPE_NORMAL] * len(pad))
    if "tokenizer.ggml.scores" in tokenizer:
        tokenizer["tokenizer.ggml.scores"] = tokenizer["tokenizer.ggml.scores"] + [0.0] * len(pad)
    return tokenizer


def llama3_rope_freqs(shape: Shape) -> np.ndarray:
    """The converter's per-frequency divisors of Llama 3 rope scaling (low frequency factor
    1, high 4, original context 8192: every Llama 3.x release), shape (head_dim / 2,)."""
    factor, low, high, original = shape.llama3_rope_factor, 1.0, 4.0, 8192
    dims = np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim
    wavelen = 2 * math.pi * shape.rope_theta ** dims
    smooth = (original / wavelen - low) / (high - low)
    divisors = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor,
                                 1 / ((1 - smooth) / factor + smooth)))
    return divisors.astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", choices=SHAPES)
    parser.add_argument("qtype", nargs="?", default="Q4_K_M")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                        help="folder of llama-quantize (for types other than F16/Q8_0/Q4_0)")
    parser.add_argument("--list", action="store_true", help="list the shapes")
    args = parser.parse_args()
    if args.list or args.shape is None:
        for name, shape in SHAPES.items():
            ffn = (f"{shape.experts} experts of {shape.expert_intermediate}, "
                   f"{shape.experts_per_token} a token ({shape.active_params / 1e9:.2f}B "
                   f"active)" if shape.experts else f"ffn {shape.intermediate_size}")
            print(f"{name:<18}{shape.arch:<9}{shape.num_params / 1e9:6.2f}B  hidden "
                  f"{shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads}/"
                  f"{shape.num_kv_heads} heads of {shape.head_dim}, {ffn}, vocab "
                  f"{shape.vocab_size}{', tied' if shape.tied_embeddings else ''}")
        return 0
    print(shape_gguf(args.shape, args.qtype, args.cache, args.llama_bin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
