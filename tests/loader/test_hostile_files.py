"""Hostile model files: fuzzed GGUF headers, truncated safetensors, bad config.json.

Whatever a file holds, loading it ends in a clean load or in one of llmserve's errors
with a one-line message naming the problem; never another exception, a crash, a hang, or
an allocation out of proportion to the file.
"""

import functools
import itertools
import json
import re
import signal
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from llmserve.errors import ModelFormatError, UnsupportedModelError
from llmserve.loader.gguf import load_gguf, read_gguf_config
from llmserve.loader.hf import load_hf_folder
from llmserve.loader.model_loader import load_model
from llmserve.tokenizer import Tokenizer

# --- a tiny Llama GGUF, written by hand so every header field's offset is known -------------

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*SPECIAL_TOKENS, *"abcdefgh", "\u0120", "ab", "cd", "abcd", "\u0120a"]
MERGES = ["a b", "c d", "ab cd", "\u0120 a"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")

METADATA: dict[str, tuple[VT, Any]] = {
    "general.architecture": (VT.STRING, "llama"),
    "general.alignment": (VT.UINT32, 32),
    "llama.context_length": (VT.UINT32, 256),
    "llama.embedding_length": (VT.UINT32, HIDDEN),
    "llama.block_count": (VT.UINT32, LAYERS),
    "llama.feed_forward_length": (VT.UINT32, INTERMEDIATE),
    "llama.attention.head_count": (VT.UINT32, HEADS),
    "llama.attention.head_count_kv": (VT.UINT32, KV_HEADS),
    "llama.rope.freq_base": (VT.FLOAT32, 10000.0),
    "llama.attention.layer_norm_rms_epsilon": (VT.FLOAT32, 1e-5),
    "tokenizer.ggml.model": (VT.STRING, "gpt2"),
    "tokenizer.ggml.pre": (VT.STRING, "gpt-2"),
    "tokenizer.ggml.tokens": (VT.ARRAY, (VT.STRING, TOKENS)),
    "tokenizer.ggml.token_type": (VT.ARRAY, (VT.INT32, [3] * 3 + [1] * (len(TOKENS) - 3))),
    "tokenizer.ggml.merges": (VT.ARRAY, (VT.STRING, MERGES)),
    "tokenizer.ggml.bos_token_id": (VT.UINT32, 1),
    "tokenizer.ggml.eos_token_id": (VT.UINT32, 2),
    "tokenizer.chat_template": (VT.STRING, CHAT_TEMPLATE),
}

# name -> (torch shape (out, in), GGUF type); a mix of float and quantized types
LAYER_TENSORS = {
    "attn_norm.weight": ((HIDDEN,), QT.F32),
    "attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), QT.Q8_0),
    "attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), QT.Q4_0),
    "attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), QT.Q4_1),
    "attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), QT.F16),
    "ffn_norm.weight": ((HIDDEN,), QT.F32),
    "ffn_gate.weight": ((INTERMEDIATE, HIDDEN), QT.Q8_0),
    "ffn_up.weight": ((INTERMEDIATE, HIDDEN), QT.BF16),
    "ffn_down.weight": ((HIDDEN, INTERMEDIATE), QT.F16),
}
TENSORS = {
    "token_embd.weight": ((len(TOKENS), HIDDEN), QT.F16),
    "output_norm.weight": ((HIDDEN,), QT.F32),
    **{f"blk.{i}.{name}": spec for i in range(LAYERS) for name, spec in LAYER_TENSORS.items()},
}

_SCALAR_FORMATS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
                   VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?",
                   VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


@dataclass(frozen=True)
class Field:
    """An integer of the header: what it is, where it sits, its struct format."""

    label: str
    offset: int
    fmt: str


@dataclass
class GGUFImage:
    """A GGUF file's bytes with a map of its header: integer fields and region starts."""

    data: bytes
    fields: list[Field]
    regions: dict[str, int]  # "kv tokenizer.ggml.tokens", "tensor info blk.0...", "data"

    def with_field(self, field: Field, value: int) -> bytes:
        """The file with `field` overwritten (wrapped to its width)."""
        size = struct.calcsize(field.fmt)
        packed = (value % (1 << (8 * size))).to_bytes(size, "little")
        return self.data[:field.offset] + packed + self.data[field.offset + size:]


class _Writer:
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.fields: list[Field] = []
        self.regions: dict[str, int] = {}

    def int(self, fmt: str, value: int, label: str) -> None:
        self.fields.append(Field(label, len(self.buffer), fmt))
        self.buffer += struct.pack(fmt, value)

    def string(self, text: str, label: str) -> None:
        data = text.encode()
        self.int("<Q", len(data), f"{label} length")
        self.buffer += data

    def value(self, value_type: VT, value: Any, label: str) -> None:
        if value_type == VT.STRING:
            self.string(value, label)
        elif value_type == VT.ARRAY:
            item_type, items = value
            self.int("<I", item_type, f"{label} item type")
            self.int("<Q", len(items), f"{label} count")
            for i, item in enumerate(items):
                self.value(item_type, item, f"{label}[{i}]")
        elif value_type in (VT.FLOAT32, VT.FLOAT64):
            self.buffer += struct.pack(_SCALAR_FORMATS[value_type], value)
        else:
            self.int(_SCALAR_FORMATS[value_type], value, label)


@functools.cache
def _tensor_bytes(shape: tuple[int, ...], qtype: QT, seed: int) -> bytes:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
    if qtype == QT.F32:
        return values.tobytes()
    if qtype == QT.F16:
        return values.astype(np.float16).tobytes()
    return gguf.quants.quantize(values, qtype).tobytes()


def build_gguf(metadata: dict[str, tuple[VT, Any]] = METADATA,
               tensors: dict[str, tuple[tuple[int, ...], QT]] = TENSORS,
               tensor_values: dict[str, np.ndarray] | None = None,
               alignment: int = 32) -> GGUFImage:
    """A GGUF v3 file of `metadata` and `tensors` (torch shapes; random values unless given
    as float32 in `tensor_values`), data aligned."""
    w = _Writer()
    w.regions["header"] = 0
    w.int("<I", int.from_bytes(b"GGUF", "little"), "magic")
    w.int("<I", 3, "version")
    w.int("<Q", len(tensors), "tensor count")
    w.int("<Q", len(metadata), "kv count")
    for key, (value_type, value) in metadata.items():
        w.regions[f"kv {key}"] = len(w.buffer)
        w.string(key, f"key {key}")
        w.int("<I", value_type, f"{key} type")
        w.value(value_type, value, key)
    given = tensor_values or {}
    blobs = [given[name].tobytes() if name in given else _tensor_bytes(shape, qtype, seed)
             for seed, (name, (shape, qtype)) in enumerate(tensors.items())]
    offset = 0
    for (name, (shape, qtype)), blob in zip(tensors.items(), blobs, strict=True):
        w.regions[f"tensor info {name}"] = len(w.buffer)
        w.string(name, f"tensor {name} name")
        w.int("<I", len(shape), f"tensor {name} n_dims")
        for i, dim in enumerate(reversed(shape)):  # GGUF lists the innermost dimension first
            w.int("<Q", dim, f"tensor {name} dim {i}")
        w.int("<I", qtype, f"tensor {name} type")
        w.int("<Q", offset, f"tensor {name} offset")
        offset += -(-len(blob) // alignment) * alignment
    w.regions["padding"] = len(w.buffer)
    w.buffer += bytes(-len(w.buffer) % alignment)
    for name, blob in zip(tensors, blobs, strict=True):
        w.regions[f"data {name}"] = len(w.buffer)
        w.buffer += blob
        w.regions["data end"] = len(w.buffer)  # the last tensor's end, before its padding
        w.buffer += bytes(-len(blob) % alignment)
    w.regions["end"] = len(w.buffer)
    return GGUFImage(bytes(w.buffer), w.fields, w.regions)


@functools.cache
def tiny_gguf() -> GGUFImage:
    return build_gguf()


# --- what every load must do ----------------------------------------------------------------

HANG_SECONDS = 30
FUZZ = dict(deadline=timedelta(seconds=10), derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW_FACTOR = 25  # examples of a `slow` run per example of the default run


class _Hang(BaseException):  # not an Exception: no `except Exception` in a loader eats it
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def hang(*_: Any) -> None:
        raise _Hang(f"still loading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(load: Callable[[Path], Any], path: Path) -> str:
    """"ok", or the message of the llmserve error `load(path)` raised (one line, not empty).
    Any other exception, or a hang, fails the test."""
    with _time_limit(HANG_SECONDS):
        try:
            load(path)
        except (ModelFormatError, UnsupportedModelError) as e:
            message = str(e)
            assert message and "\n" not in message, repr(message)
            return message
    return "ok"


GGUF_LOADS = (read_gguf_config, load_gguf, Tokenizer.from_gguf)


def check_gguf(data: bytes, path: Path, full_model: bool = True) -> list[str]:
    """Each outcome of loading `data` as a GGUF file (and as a model, with `full_model`)."""
    path.write_bytes(data)
    loads = (*GGUF_LOADS, load_model) if full_model else GGUF_LOADS
    return [outcome(load, path) for load in loads]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


def test_tiny_gguf_loads(work: Path) -> None:
    """The file every mutation starts from loads, tokenizer and model included."""
    path = work / "tiny.gguf"
    assert check_gguf(tiny_gguf().data, path) == ["ok"] * 4
    config = read_gguf_config(path)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        HIDDEN, LAYERS, len(TOKENS))
    assert Tokenizer.from_gguf(path).encode("abcd") == [TOKENS.index("abcd")]
    loaded = load_model(str(path))
    assert loaded.config == config and config.tie_word_embeddings  # no output.weight
    assert len(loaded.model.model.layers) == LAYERS


# --- fuzzed header fields, truncation, byte flips, metadata values --------------------------

EDGE_VALUES = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 1 << 16, (1 << 31) - 1,
               1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@st.composite
def field_values(draw: st.DrawFn) -> tuple[Field, int]:
    """A header field and a hostile value for it: an edge value, its own value nudged,
    another tensor's offset (overlap), the file's size, or anything."""
    image = tiny_gguf()
    field = draw(st.sampled_from(image.fields))
    width = struct.calcsize(field.fmt)
    own = int.from_bytes(image.data[field.offset:field.offset + width], "little")
    offsets = [int.from_bytes(image.data[f.offset:f.offset + 8], "little")
               for f in image.fields if f.label.endswith(" offset")]
    value = draw(st.one_of(
        st.sampled_from(EDGE_VALUES),
        st.integers(-64, 64).map(lambda delta: max(own + delta, 0)),
        st.sampled_from(offsets),
        st.just(len(image.data)),
        st.integers(0, (1 << (8 * width)) - 1),
    ))
    return field, value


def _header_field(work: Path, mutation: tuple[Field, int]) -> None:
    field, value = mutation
    check_gguf(tiny_gguf().with_field(field, value), work / "field.gguf")


def _byte_flips(work: Path, flips: list[tuple[int, int]]) -> None:
    data = bytearray(tiny_gguf().data)
    for position, byte in flips:
        data[position % tiny_gguf().regions["padding"]] = byte  # the header: data is opaque
    check_gguf(bytes(data), work / "flips.gguf", full_model=False)


INT_RANGES = {VT.UINT8: (0, 255), VT.INT8: (-128, 127), VT.UINT16: (0, 65535),
              VT.INT16: (-32768, 32767), VT.UINT32: (0, (1 << 32) - 1),
              VT.INT32: (-(1 << 31), (1 << 31) - 1), VT.UINT64: (0, (1 << 64) - 1),
              VT.INT64: (-(1 << 63), (1 << 63) - 1)}
STRINGS = ["", "llama", "gemma3", "qwen2", "qwen3", "rwkv6", "gpt2", "none", "linear", "yarn",
           "llama3", "a b", "ab cd", "a z", "{{ raise_exception('no') }}", "{% for", "x" * 5000]


def _values_of(value_type: VT) -> st.SearchStrategy[Any]:
    if value_type in INT_RANGES:
        low, high = INT_RANGES[value_type]
        edges = [v for v in [*EDGE_VALUES, -1, -(1 << 31)] if low <= v <= high]
        return st.one_of(st.sampled_from(edges), st.integers(low, high))
    if value_type in (VT.FLOAT32, VT.FLOAT64):
        return st.floats(width=32)
    if value_type == VT.BOOL:
        return st.booleans()
    return st.one_of(st.sampled_from(STRINGS), st.text(max_size=40))


SCALAR_TYPES = [*INT_RANGES, VT.FLOAT32, VT.FLOAT64, VT.BOOL, VT.STRING]
TYPED_VALUES = st.one_of(
    st.sampled_from(SCALAR_TYPES).flatmap(lambda t: _values_of(t).map(lambda v: (t, v))),
    st.sampled_from(SCALAR_TYPES).flatmap(
        lambda t: st.lists(_values_of(t), max_size=40).map(lambda vs: (VT.ARRAY, (t, vs)))),
)
# keys the loaders read that the tiny file lacks
EXTRA_KEYS = ["llama.attention.key_length", "llama.rope.dimension_count",
              "llama.rope.scaling.type", "llama.rope.scaling.factor",
              "llama.rope.scaling.original_context_length", "llama.attention.sliding_window",
              "llama.attn_logit_softcapping", "llama.final_logit_softcapping",
              "tokenizer.ggml.scores", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
              "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"]
# (key, typed value or None: drop the key)
METADATA_EDITS = st.lists(
    st.tuples(st.sampled_from([*METADATA, *EXTRA_KEYS]), st.none() | TYPED_VALUES),
    min_size=1, max_size=3)


def _metadata_values(work: Path, edits: list[tuple[str, tuple[VT, Any] | None]]) -> None:
    metadata = dict(METADATA)
    for key, typed_value in edits:
        if typed_value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = typed_value
    check_gguf(build_gguf(metadata).data, work / "metadata.gguf")


def _fuzz_tests(body: Callable[..., None], examples: int, **strategies: Any
                ) -> tuple[Callable[..., None], Callable[..., None]]:
    """`body` under hypothesis: a bounded default run and a `slow` one 25 times longer."""
    default = settings(max_examples=examples, **FUZZ)(given(**strategies)(body))
    slow = settings(max_examples=examples * SLOW_FACTOR, **FUZZ)(given(**strategies)(body))
    return default, pytest.mark.slow(slow)


test_header_fields, test_header_fields_slow = _fuzz_tests(
    _header_field, 150, mutation=field_values())
test_byte_flips, test_byte_flips_slow = _fuzz_tests(
    _byte_flips, 60, flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                    min_size=1, max_size=8))
test_metadata_values, test_metadata_values_slow = _fuzz_tests(
    _metadata_values, 100, edits=METADATA_EDITS)


def test_truncated_at_every_region(work: Path) -> None:
    """Cut at the start, one byte in and half-way through each region (header, each
    metadata pair, each tensor info, padding, each tensor's data): always "truncated"."""
    image = tiny_gguf()
    starts = sorted(image.regions.values())
    cuts = {cut for start, end in itertools.pairwise(starts)
            for cut in (start, start + 1, (start + end) // 2)}
    for cut in sorted(c for c in cuts if c < image.regions["data end"]):
        messages = check_gguf(image.data[:cut], work / "cut.gguf", full_model=False)
        for message in messages:
            assert re.search("truncated|empty|not a GGUF file", message), (cut, message)


def test_parsing_allocates_in_proportion_to_the_file(work: Path) -> None:
    """Counts and lengths are checked against the bytes left before anything is allocated
    for them: parsing a hostile 118 KB header (2**63 strings, 2**64-1 array items, ...)
    allocates no more than it does for the intact file, give or take a megabyte."""
    path = work / "alloc.gguf"

    @settings(max_examples=40, **FUZZ)
    @given(mutation=field_values())
    def parse(mutation: tuple[Field, int]) -> None:
        path.write_bytes(tiny_gguf().with_field(*mutation))
        tracemalloc.start()
        try:
            for load in (read_gguf_config, Tokenizer.from_gguf):
                outcome(load, path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (mutation, peak)

    parse()


# --- each failure mode, with the message that names it --------------------------------------


def _field(label: str) -> Field:
    return next(f for f in tiny_gguf().fields if f.label == label)


def _offset_of(tensor: str) -> int:
    field = _field(f"tensor {tensor} offset")
    return int.from_bytes(tiny_gguf().data[field.offset:field.offset + 8], "little")


HEADER_CASES = {  # field label -> (value, error, message)
    "magic": (0, ModelFormatError, "not a GGUF file"),
    "version": (1, ModelFormatError, "unsupported GGUF version 1"),
    "tensor count": (1 << 63, ModelFormatError, "tensor count 9223372036854775808 .* cannot fit"),
    "kv count": ((1 << 64) - 1, ModelFormatError, "metadata count .* cannot fit"),
    "key general.architecture length": (
        1 << 63, ModelFormatError, "truncated: a metadata key of 9223372036854775808 bytes"),
    "general.architecture type": (13, ModelFormatError, "unknown value type 13"),
    "general.alignment": (48, ModelFormatError, "general.alignment must be a power of two"),
    "tokenizer.ggml.tokens count": (1 << 62, ModelFormatError, "string count .* cannot fit"),
    "tokenizer.ggml.token_type count": (
        1 << 61, ModelFormatError, "truncated: the 2305843009213693952 items"),
    "tokenizer.ggml.tokens item type": (9, ModelFormatError, "array of arrays"),
    "tokenizer.ggml.merges item type": (99, ModelFormatError, "unknown item type 99"),
    "tokenizer.ggml.tokens[3] length": (1 << 40, ModelFormatError, "truncated: item 3 of"),
    "tensor token_embd.weight n_dims": (7, ModelFormatError, "7 dimensions"),
    "tensor blk.0.attn_q.weight dim 1": (
        (1 << 62) + 64, ModelFormatError, "tensor 'blk.0.attn_q.weight' .* runs past the end"),
    "tensor blk.0.attn_q.weight dim 0": (48, ModelFormatError, "not whole Q8_0 blocks of 32"),
    "tensor blk.1.ffn_up.weight dim 1": (0, ModelFormatError, r"mlp.up_proj.weight has shape "
                                         r"\(0, 64\), the config implies \(128, 64\)"),
    "tensor blk.0.attn_k.weight type": (1000, ModelFormatError, "unknown tensor type 1000"),
    "tensor blk.0.attn_q.weight type": (
        QT.I8, UnsupportedModelError, "unsupported GGUF tensor type I8 in blk.0.attn_q.weight"),
    "tensor blk.0.attn_q.weight offset": (
        _offset_of("blk.0.attn_q.weight") + 1, ModelFormatError, "not a multiple of the align"),
    "tensor blk.0.attn_k.weight offset": (
        _offset_of("blk.0.attn_q.weight"), ModelFormatError,
        "tensors 'blk.0.attn_k.weight' and 'blk.0.attn_q.weight' overlap"),
    "tensor output_norm.weight offset": (1 << 63, ModelFormatError, "runs past the end"),
}


@pytest.mark.parametrize("label", HEADER_CASES)
def test_hostile_header_field(label: str, work: Path) -> None:
    value, error, message = HEADER_CASES[label]
    path = work / "case.gguf"
    path.write_bytes(tiny_gguf().with_field(_field(label), value))
    for load in (load_gguf, load_model):
        with pytest.raises(error, match=message):
            load(path)


METADATA_CASES = {  # key -> (typed value, error, message)
    "llama.block_count": (
        (VT.UINT64, 1 << 40), ModelFormatError, "'llama.block_count' is 1099511627776, but "
                                                "the file holds 20 tensors"),
    "llama.embedding_length": ((VT.STRING, "64"), ModelFormatError,
                               "'llama.embedding_length' must be an integer >= 1, got '64'"),
    "llama.feed_forward_length": ((VT.UINT64, 1 << 40), ModelFormatError,
                                  r"mlp.gate_proj.weight has shape \(128, 64\), the "
                                  r"config implies \(1099511627776, 64\)"),
    "llama.context_length": ((VT.UINT64, 1 << 40), ModelFormatError,
                             "max_position_embeddings 1099511627776 x head_dim 16 is beyond"),
    "llama.attention.head_count": ((VT.UINT32, 0), ModelFormatError,
                                   "'llama.attention.head_count' must be an integer >= 1"),
    "llama.attention.head_count_kv": ((VT.UINT32, 3), UnsupportedModelError,
                                      r"num_attention_heads \(4\) is not a multiple"),
    "llama.rope.freq_base": ((VT.STRING, "1e4"), ModelFormatError,
                             "'llama.rope.freq_base' must be a number, got '1e4'"),
    "llama.attention.key_length": ((VT.UINT32, 15), ModelFormatError, "head_dim must be even"),
    "general.architecture": ((VT.ARRAY, (VT.UINT8, [1, 2])), UnsupportedModelError,
                             r"unsupported GGUF architecture \[1, 2\]"),
    "general.alignment": ((VT.BOOL, False), ModelFormatError, "power of two, got False"),
    "llama.rope.scaling.type": ((VT.STRING, "linear"), ModelFormatError,
                                "rope_scaling factor must be a positive number, got None"),
}


@pytest.mark.parametrize("key", METADATA_CASES)
def test_hostile_metadata_value(key: str, work: Path) -> None:
    typed_value, error, message = METADATA_CASES[key]
    path = work / "case.gguf"
    path.write_bytes(build_gguf({**METADATA, key: typed_value}).data)
    for load in (read_gguf_config, load_gguf, load_model):
        with pytest.raises(error, match=message):
            load(path)


@pytest.mark.parametrize("layers, message", [
    (3, "holds 20 tensors, too few for 3 layers of 9"),
    (1, "tensor 'model.layers.1.input_layernorm.weight' has no place in a 1-layer llama"),
])
def test_layer_count_against_tensors(layers: int, message: str, work: Path) -> None:
    path = work / "case.gguf"
    metadata = {**METADATA, "llama.block_count": (VT.UINT32, layers)}
    path.write_bytes(build_gguf(metadata).data)
    with pytest.raises(ModelFormatError, match=message):
        load_gguf(path)


TOKENIZER_CASES = {  # key -> (typed value, message)
    "tokenizer.ggml.token_type": ((VT.ARRAY, (VT.INT32, [1] * (len(TOKENS) - 1))),
                                  "token_type has 15 entries for 16 tokens"),
    "tokenizer.ggml.bos_token_id": ((VT.UINT32, len(TOKENS)),
                                    "bos_token_id is 16, outside the 16 tokens"),
    "tokenizer.ggml.eos_token_id": ((VT.STRING, "</s>"), "eos_token_id must be a token id"),
    "tokenizer.ggml.tokens": ((VT.ARRAY, (VT.UINT32, list(range(16)))),
                              "tokens must be a list of strings"),
    "tokenizer.ggml.merges": ((VT.ARRAY, (VT.STRING, ["a " * 200_000])),
                              "tokenizer.ggml.merges: 'Error while initializing BPE"),
    "tokenizer.ggml.scores": ((VT.ARRAY, (VT.STRING, ["1"] * 16)), "scores must be a list of"),
    "tokenizer.ggml.pre": ((VT.ARRAY, (VT.STRING, ["gpt-2"])), "pre must be a string"),
}


@pytest.mark.parametrize("key", TOKENIZER_CASES)
def test_hostile_tokenizer_metadata(key: str, work: Path) -> None:
    typed_value, message = TOKENIZER_CASES[key]
    path = work / "case.gguf"
    path.write_bytes(build_gguf({**METADATA, key: typed_value}).data)
    for load in (Tokenizer.from_gguf, load_model):
        with pytest.raises(ModelFormatError, match=message):
            load(path)


def test_sentencepiece_token_too_long(work: Path) -> None:
    """Recovering SentencePiece merges is quadratic in a token's length: refused early."""
    tokens = ["<unk>", "a", "a" * 5000]
    metadata = {**METADATA, "tokenizer.ggml.model": (VT.STRING, "llama"),
                "tokenizer.ggml.tokens": (VT.ARRAY, (VT.STRING, tokens)),
                "tokenizer.ggml.token_type": (VT.ARRAY, (VT.INT32, [2, 1, 1]))}
    path = work / "case.gguf"
    path.write_bytes(build_gguf(metadata).data)
    with pytest.raises(ModelFormatError, match="a token of 5000 characters"):
        Tokenizer.from_gguf(path)


def test_llama3_rope_freqs(work: Path) -> None:
    """A Llama 3 file's `rope_freqs` tensor (F32 divisors) gives its rope scaling back (its
    bytes were once read as 4x as many uint8 values, refusing every Llama 3 GGUF)."""
    inv_freq = 10000.0 ** -(np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    wavelen = 2 * np.pi / inv_freq
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    divisors = np.where(wavelen < 8192 / 4.0, 1.0, 1 / ((1 - smooth) / 8.0 + smooth))
    divisors = np.where(wavelen > 8192 / 1.0, 8.0, divisors).astype(np.float32)
    path = work / "llama3.gguf"
    path.write_bytes(build_gguf(tensors={**TENSORS, "rope_freqs.weight": (
        (HEAD_DIM // 2,), QT.F32)}, tensor_values={"rope_freqs.weight": divisors}).data)
    scaling = read_gguf_config(path).rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(8.0)
    assert load_model(str(path)).config.rope_scaling == scaling


# --- Hugging Face folders: truncated or lying safetensors, bad config.json ------------------

HF_CONFIG = {"model_type": "llama", "vocab_size": len(TOKENS), "hidden_size": HIDDEN,
             "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
HF_LAYER = {"input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
            "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}
HF_SHAPES = {"model.embed_tokens.weight": (len(TOKENS), HIDDEN), "model.norm.weight": (HIDDEN,),
             "lm_head.weight": (len(TOKENS), HIDDEN),
             **{f"model.layers.{i}.{name}": shape
                for i in range(LAYERS) for name, shape in HF_LAYER.items()}}
HF_LOADS = (load_hf_folder, load_model)


def hf_folder(folder: Path, config: Any = HF_CONFIG,
              shapes: dict[str, tuple[int, ...]] = HF_SHAPES) -> Path:
    """A tiny Llama folder: config.json, model.safetensors (random bf16), tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(shape, generator=generator).to(torch.bfloat16)
               for name, shape in shapes.items()}, folder / "model.safetensors")
    merges = [tuple(m.split(" ")) for m in MERGES]
    vocab = {token: i for i, token in enumerate(TOKENS)}
    HFTokenizer(models.BPE(vocab, merges)).save(str(folder / "tokenizer.json"))
    return folder


def _hf_raises(folder: Path, error: type[Exception], message: str) -> None:
    for load in HF_LOADS:
        with pytest.raises(error, match=message) as caught:
            load(folder)
        assert "\n" not in str(caught.value)


def test_tiny_hf_folder_loads(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "tiny")
    assert [outcome(load, folder) for load in HF_LOADS] == ["ok", "ok"]
    assert load_model(str(folder)).config.num_hidden_layers == LAYERS


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8:8 + length])


@pytest.mark.parametrize("where", ["length", "header", "data", "last byte"])
def test_truncated_safetensors(where: str, tmp_path: Path) -> None:
    folder = hf_folder(tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    length, _ = _safetensors_header(file)
    cut = {"length": 5, "header": 8 + length // 2, "data": (8 + length + len(data)) // 2,
           "last byte": len(data) - 1}[where]
    file.write_bytes(data[:cut])
    _hf_raises(folder, ModelFormatError, "cannot read .*model.safetensors")


SAFETENSORS_LIES = {  # what the header says of model.norm.weight -> (error, message)
    "offsets past the end": ({"data_offsets": [0, 1 << 40]}, ModelFormatError,
                             "cannot read .*invalid offset for tensor `model.norm.weight`"),
    "shape and size disagree": ({"shape": [HIDDEN * 2]}, ModelFormatError,
                                "cannot read .*invalid shape, data type, or offset"),
    "negative dimension": ({"shape": [-HIDDEN]}, ModelFormatError, "cannot read .*invalid JSON"),
    "unknown dtype": ({"dtype": "Q4"}, ModelFormatError, "cannot read .*unknown variant `Q4`"),
    "integer dtype": ({"dtype": "I16"}, UnsupportedModelError,
                      "tensor 'model.norm.weight' has dtype I16"),
    "shape the config does not imply": ({"dtype": "F32", "shape": [HIDDEN // 2]},
                                        ModelFormatError, r"tensor model.norm.weight has shape "
                                        r"\(32,\), the config implies \(64,\)"),
}


@pytest.mark.parametrize("lie", SAFETENSORS_LIES)
def test_lying_safetensors_header(lie: str, tmp_path: Path) -> None:
    entry, error, message = SAFETENSORS_LIES[lie]
    folder = hf_folder(tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    length, header = _safetensors_header(file)
    header["model.norm.weight"].update(entry)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])
    _hf_raises(folder, error, message)


def test_checkpoint_tensors_against_config(tmp_path: Path) -> None:
    shapes = {**HF_SHAPES, "model.layers.0.self_attn.o_proj.bias": (HIDDEN,)}
    _hf_raises(hf_folder(tmp_path / "extra", shapes=shapes), ModelFormatError,
               "tensor 'model.layers.0.self_attn.o_proj.bias' has no place in a 2-layer llama")
    shapes = {k: v for k, v in HF_SHAPES.items() if "layers.1.mlp" not in k}
    _hf_raises(hf_folder(tmp_path / "missing", shapes=shapes), ModelFormatError,
               r"lacks tensor\(s\) model.layers.1.mlp.gate_proj.weight, "
               r"model.layers.1.mlp.up_proj.weight, model.layers.1.mlp.down_proj.weight")


CONFIG_CASES = {  # config.json edit -> (error, message)
    "not JSON": ("{'model_type': 'llama'", ModelFormatError, "cannot read .*config.json"),
    "deeply nested": ("[" * 100_000, ModelFormatError, "cannot read .*config.json"),
    "not an object": ([HF_CONFIG], ModelFormatError, "config.json is not a JSON object"),
    "missing field": ({"hidden_size": None}, ModelFormatError,
                      "config.json lacks the field 'hidden_size'"),
    "string for an int": ({"num_attention_heads": "4"}, ModelFormatError,
                          "num_attention_heads must be a positive integer, got '4'"),
    "negative size": ({"intermediate_size": -128}, ModelFormatError,
                      "intermediate_size must be a positive integer, got -128"),
    "zero vocabulary": ({"vocab_size": 0}, ModelFormatError, "vocab_size must be a positive"),
    "heads not dividing hidden": ({"num_attention_heads": 5}, ModelFormatError,
                                  "hidden_size 64 is not a multiple of num_attention_heads 5"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, UnsupportedModelError,
                                    r"num_attention_heads \(4\) is not a multiple of"),
    "terabytes of hidden size": ({"hidden_size": 1 << 40, "head_dim": HEAD_DIM},
                                 ModelFormatError, r"tensor lm_head.weight has shape "
                                 r"\(16, 64\), the config implies \(16, 1099511627776\)"),
    "2**40 layers": ({"num_hidden_layers": 1 << 40, "sliding_window": 4}, ModelFormatError,
                     "num_hidden_layers 1099511627776 is beyond any model's"),
    "more layers than tensors": ({"num_hidden_layers": 1 << 16}, ModelFormatError,
                                 "holds 21 tensors, too few for 65536 layers of 9"),
    "2**40 positions": ({"max_position_embeddings": 1 << 40}, ModelFormatError,
                        "max_position_embeddings 1099511627776 x head_dim 16 is beyond"),
    "rotary tables outgrowing the model": (
        {"max_position_embeddings": 1 << 21}, ModelFormatError,
        "max_position_embeddings 2097152 x head_dim 16 is beyond any model's .* than the "
        r"model's \d+ weights"),
    "unknown model_type": ({"model_type": "gpt_neox"}, UnsupportedModelError,
                           "architecture 'gpt_neox'"),
    "model_type a list": ({"model_type": ["llama"]}, UnsupportedModelError,
                          r"architecture \['llama'\]"),
    "string flag": ({"tie_word_embeddings": "false"}, ModelFormatError,
                    "tie_word_embeddings must be true or false, got 'false'"),
    "string epsilon": ({"rms_norm_eps": "1e-5"}, ModelFormatError, "rms_norm_eps must be"),
    "rope_scaling a string": ({"rope_scaling": "linear"}, ModelFormatError,
                              "rope_scaling must be an object"),
    "rope factor missing": ({"rope_scaling": {"rope_type": "linear"}}, ModelFormatError,
                            "rope_scaling factor must be a positive number, got None"),
    "mrope sections not half the head": (
        {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, "24"]}}, ModelFormatError,
        r"mrope_section must be three positive numbers adding up to half the head size"),
    "sliding window a string": ({"sliding_window": "4096"}, ModelFormatError,
                                "sliding_window must be a positive integer, got '4096'"),
    "NaN theta": ({"rope_theta": float("nan")}, ModelFormatError,
                  "rope_theta must be a positive number, got nan"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_json(case: str, tmp_path: Path) -> None:
    edit, error, message = CONFIG_CASES[case]
    folder = hf_folder(tmp_path)
    if isinstance(edit, dict):
        config = {**HF_CONFIG, **edit}
        text = json.dumps({k: v for k, v in config.items() if v is not None})
    else:
        text = edit if isinstance(edit, str) else json.dumps(edit)
    (folder / "config.json").write_text(text)
    _hf_raises(folder, error, message)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=8) | st.just([]) | st.just({})
    | st.sampled_from([0, 1, 2, 3, 4, 5, 16, 64, 128, -1, 1 << 31, 1 << 40, 1 << 63])
    | st.integers(),
    lambda children: (st.lists(children, min_size=1, max_size=4)
                      | st.dictionaries(st.text(max_size=8), children, min_size=1, max_size=4)),
    max_leaves=8)
CONFIG_KEYS = [*HF_CONFIG, "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
               "sliding_window", "layer_types", "use_sliding_window", "max_window_layers",
               "attention_bias", "hidden_act", "query_pre_attn_scalar"]
CONFIG_EDITS = st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, min_size=1,
                               max_size=3)


def _config_values(work: Path, edits: dict[str, Any]) -> None:
    folder = work / "fuzzed"
    if not folder.exists():
        hf_folder(folder)
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, **edits}))
    for load in HF_LOADS:
        outcome(load, folder)


test_config_values, test_config_values_slow = _fuzz_tests(
    _config_values, 100, edits=CONFIG_EDITS)
