"""The kernel library's C functions (kernels.h), each declared once as a typed method of
`Kernels`.

A method's annotations are its C signature: `Ptr` (any pointer: a tensor's `data_ptr()`, a
ctypes struct's address, or None for NULL), `Int64`, `Int32`, `Float32`, `CharP`; its name is
the symbol's without `llmserve_`. Loading a library checks it once, so that a call never
meets a stale or partial build: its ABI (`llmserve_kernels_abi`) must be this package's
`LLMSERVE_KERNELS_ABI` (read from kernels.h, which ships with the sources), and it must
export every declared function; otherwise it is refused with `IncompatibleLibrary`. Each
method is then replaced on the instance by the C function itself, its ctypes argtypes and
restype taken from the annotations: a call costs what a raw ctypes call costs.
"""

import ctypes
import inspect
import os
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

HEADER = Path(__file__).with_name("kernels.h")

Ptr = Annotated[int | None, ctypes.c_void_p]
Int64 = Annotated[int, ctypes.c_int64]
Int32 = Annotated[int, ctypes.c_int32]
Float32 = Annotated[float, ctypes.c_float]
CharP = Annotated[bytes, ctypes.c_char_p]


def header_abi() -> int:
    """The ABI version kernels.h defines (`LLMSERVE_KERNELS_ABI`)."""
    match = re.search(r"^#define LLMSERVE_KERNELS_ABI (\d+)$", HEADER.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{HEADER} defines no LLMSERVE_KERNELS_ABI")
    return int(match.group(1))


ABI = header_abi()


class IncompatibleLibrary(Exception):
    """A kernel library this package cannot call: another ABI, or a function missing."""


class Kernels:
    """A loaded kernel library. Every public method below is the C function
    `llmserve_<name>` (its body never runs); shapes are in kernels.h and the sources."""

    def __init__(self, cdll: ctypes.CDLL, path: str | os.PathLike[str]) -> None:
        """Binds `cdll`, loaded from `path`; raises IncompatibleLibrary, naming the file and
        the mismatch, if its ABI is not kernels.h's or it lacks a declared function."""
        self.path = Path(path)
        self.origin = "loaded"  # where the loader found the file: "prebuilt", "cached", "built"
        self._bind(cdll, "kernels_abi")
        if (abi := self.kernels_abi()) != ABI:
            raise IncompatibleLibrary(f"{self.path}: its ABI is {abi}, this llmserve's is {ABI} "
                                      f"(kernels.h); rebuild it from these sources")
        missing = [name for name in SIGNATURES if not hasattr(cdll, f"llmserve_{name}")]
        if missing:
            names = ", ".join(f"llmserve_{name}" for name in missing)
            raise IncompatibleLibrary(f"{self.path}: its ABI is {abi}, but it lacks {names}, "
                                      f"which kernels.h declares")
        for name in SIGNATURES:
            self._bind(cdll, name)

    def _bind(self, cdll: ctypes.CDLL, name: str) -> None:
        try:
            fn = getattr(cdll, f"llmserve_{name}")
        except AttributeError:
            raise IncompatibleLibrary(f"{self.path}: it lacks llmserve_{name}") from None
        fn.argtypes, fn.restype = SIGNATURES[name]
        setattr(self, name, fn)

    # the library's identity and its thread pool (kernels_api.cpp)
    def kernels_abi(self) -> Int32:
        """The library's LLMSERVE_KERNELS_ABI."""

    def kernels_level(self) -> CharP:
        """The instruction-set level it was built for (b"avx2", b"avx512+vnni", ...)."""

    def set_num_threads(self, num_threads: Int32, spin_us: Int64) -> None:
        """A new pool of `num_threads` (the caller included), idle workers spinning `spin_us`."""

    def set_stream_prefetch(self, nontemporal: Int32) -> None:
        """Whether decodes prefetch their weights non-temporally (1, the default) or not (0)."""

    def set_amx(self, on: Int32) -> Int32:
        """Whether the K-quant GEMMs run rows in tiles of 16 on AMX (1, the default where the
        CPU has it and the kernel grants the tile state) or not (0); -1 only asks. Returns 1
        if they do after the call. The results are the same bits either way."""

    # elementwise.cpp
    def rms_norm(self, x: Ptr, T: Int64, C: Int64, weight: Ptr, eps: Float32,
                 out: Ptr) -> None:
        """out (T, C) = RMSNorm of x (T, C) with `weight`."""

    def rms_norm_heads(self, qkv: Ptr, T: Int64, row_stride: Int64, num_heads: Int64,
                       D: Int64, weight: Ptr, eps: Float32) -> None:
        """Per-head RMSNorm in place on the first `num_heads` heads of each qkv row."""

    def rotary_inplace(self, qkv: Ptr, T: Int64, row_stride: Int64, num_heads: Int64,
                       D: Int64, positions: Ptr, cos_table: Ptr, sin_table: Ptr) -> None:
        """Rotary embedding (rotate-half) in place on the q and k heads of qkv rows."""

    def silu_and_mul(self, gate_up: Ptr, T: Int64, intermediate: Int64, out: Ptr) -> None:
        """out (T, I) = silu(gate) * up of gate_up (T, 2I), I = `intermediate`."""

    def gelu_tanh_and_mul(self, gate_up: Ptr, T: Int64, intermediate: Int64,
                          out: Ptr) -> None:
        """out (T, I) = gelu_tanh(gate) * up of gate_up (T, 2I), I = `intermediate`."""

    def argmax_rows(self, x: Ptr, M: Int64, N: Int64, out: Ptr) -> None:
        """out (M,) int64 = each row's first largest index, -1 where the row holds a NaN."""

    def apply_token_bitmask(self, x: Ptr, N: Int64, words: Ptr, R: Int64, rows: Ptr) -> None:
        """-inf in rows `rows` of x (., N) wherever their bitmask `words` bit is clear."""

    # the GEMMs and their packings (gemm_int8.cpp, gemm_q4.cpp, gemm_f32.cpp)
    def pack_int8_weight(self, w: Ptr, N: Int64, K: Int64, packed: Ptr) -> None:
        """An int8 weight (N, K) into the dot4 layout (N_pad, Kp)."""

    def int8_linear(self, x: Ptr, M: Int64, K: Int64, w: Ptr, wsum: Ptr, wscale: Ptr,
                    bias: Ptr, N: Int64, y: Ptr, workspace: Ptr) -> None:
        """y (M, N) = W8A8(x (M, K)) with a packed int8 weight [+ bias]."""

    def int8_embedding(self, packed: Ptr, N: Int64, Kp: Int64, ids: Ptr, T: Int64, K: Int64,
                       scale: Ptr, out: Ptr) -> Int32:
        """out (T, K) = rows `ids` of a packed int8 weight, dequantized; 1 if an id is out
        of range."""

    def quantize_q4(self, w: Ptr, N: Int64, K: Int64, codes: Ptr, d: Ptr, m: Ptr) -> None:
        """A float weight (N, K) into 4-bit codes and fp16 scales d and offsets m."""

    def pack_q4_weight(self, codes: Ptr, d: Ptr, m: Ptr, N: Int64, K: Int64,
                       packed: Ptr) -> None:
        """4-bit codes, scales and offsets into the Q4 kernel's group records."""

    def q4_linear(self, x: Ptr, M: Int64, K: Int64, w: Ptr, bias: Ptr, N: Int64, y: Ptr,
                  workspace: Ptr, activation_bits: Int32) -> None:
        """y (M, N) = Q4 weight . x (M, K) [+ bias], activations at 15 or 8 bits."""

    def pack_f32_weight(self, w: Ptr, N: Int64, K: Int64, packed: Ptr) -> None:
        """A float weight (N, K) into blocks of 16 channels, (N_pad / 16, K, 16)."""

    def f32_linear(self, x: Ptr, M: Int64, K: Int64, w: Ptr, bias: Ptr, N: Int64,
                   y: Ptr) -> None:
        """y (M, N) = x (M, K) . W^T [+ bias] on a packed float32 weight."""

    def f32_linear_from(self, x: Ptr, M: Int64, K: Int64, w: Ptr, bias: Ptr, init: Ptr,
                        N: Int64, y: Ptr) -> None:
        """y (M, N) = [init +] x (M, K) . W^T [+ bias] on a packed float32 weight."""

    # GGUF's own blocks (gemm_kquant.cpp)
    def kquant_record_bytes(self, type: Int32) -> Int64:
        """Bytes of one record (16 channels x 256 k) of a packed weight of `type`."""

    def pack_kquant(self, blocks: Ptr, type: Int32, N: Int64, K: Int64, packed: Ptr) -> None:
        """A GGUF tensor (N, K) of `type` blocks into the records the tiles read."""

    def kquant_rows(self, packed: Ptr, type: Int32, N: Int64, K: Int64, ids: Ptr, T: Int64,
                    out: Ptr) -> Int32:
        """out (T, K) = rows `ids` of a packed K-quant weight; 1 if an id is out of range."""

    def kquant_linear(self, x: Ptr, M: Int64, K: Int64, w: Ptr, bias: Ptr, y: Ptr,
                      workspace: Ptr) -> None:
        """y (M, N) = W . x (M, K) [+ bias], W a KQuantWeight's segments."""

    # the paged KV cache (attention.cpp)
    def kv_cache_write(self, k: Ptr, v: Ptr, kv_stride: Int64, T: Int64, Hkv: Int64, D: Int64,
                       slot_mapping: Ptr, k_cache: Ptr, v_cache: Ptr, k_scales: Ptr,
                       v_scales: Ptr, dtype: Int32) -> None:
        """New keys and values (T, Hkv, D) into the paged cache at `slot_mapping`."""

    def paged_attention(self, q: Ptr, q_stride: Int64, H: Int64, D: Int64, k_cache: Ptr,
                        v_cache: Ptr, k_scales: Ptr, v_scales: Ptr, dtype: Int32,
                        block_size: Int64, Hkv: Int64, block_tables: Ptr, max_blocks: Int64,
                        query_start: Ptr, context_lens: Ptr, B: Int64, scale: Float32,
                        window: Int64, softcap: Float32, out: Ptr) -> None:
        """out = attention of the B sequences' queries over their cache blocks."""

    # LoRA, mixture-of-experts layers and the whole decoder stack (lora.cpp, moe.cpp,
    # llama_layers.cpp)
    def lora_apply(self, x: Ptr, T: Int64, K: Int64, y: Ptr, N: Int64, slot_of_row: Ptr,
                   num_slots: Int64, slots: Ptr, scratch: Ptr) -> None:
        """y (T, N) += each row's adapter update of one linear."""

    def moe_route(self, scores: Ptr, T: Int64, E: Int64, top_k: Int64, renormalize: Int32,
                  ids: Ptr, weights: Ptr) -> None:
        """Each token's top_k experts (ids) and routing weights from the router's logits."""

    def moe_combine(self, slots: Ptr, T: Int64, top_k: Int64, C: Int64, shared: Ptr,
                    gate_logits: Ptr, y: Ptr) -> None:
        """y (T, C) = each token's slots summed [+ the gated shared expert]."""

    def moe_experts(self, x: Ptr, T: Int64, C: Int64, intermediate: Int64, gate_up: Ptr,
                    down: Ptr, first: Int64, num_held: Int64, ids: Ptr, weights: Ptr,
                    top_k: Int64, slots: Ptr, scratch: Ptr, qscratch: Ptr) -> None:
        """slots (T * top_k, C) = the held experts' weighted outputs, zero for the others."""

    def moe_block(self, x: Ptr, T: Int64, C: Int64, moe: Ptr, y: Ptr, qscratch: Ptr) -> None:
        """y (T, C) = a whole mixture layer (a MoeLayer) of x (T, C)."""

    def llama_layers(self, x: Ptr, T: Int64, shape: Ptr, layers: Ptr, num_layers: Int64,
                     step: Ptr, scratch: Ptr, qscratch: Ptr, lora_step: Ptr) -> None:
        """The residual stream x (T, hidden) through `num_layers` decoder layers in place."""

    def eagle_draft(self, chain: Ptr, embeds: Ptr, hidden: Ptr, T: Int64, N: Int64,
                    query_lens: Ptr, starts: Ptr, block_tables: Ptr, max_blocks: Int64,
                    wanted: Ptr, keep_at: Ptr, go_on_at: Ptr, cut: Int32, drafts: Ptr,
                    max_drafts: Int64, scratch: Ptr, qscratch: Ptr) -> None:
        """An EAGLE-1 head's first pass over N sequences' T verified rows and its greedy
        draft chains (wanted: on return, the drafts each sequence got)."""

    # the machine's int8 dot-product peak (peak.cpp)
    def int8_dot_peak(self, iterations: Int64, sink: Ptr) -> Int64:
        """Integer operations done by `iterations` rounds of dot4 steps on every thread."""


def _ctypes_of(hint: object) -> type | None:
    return None if hint is None or hint is type(None) else typing.get_args(hint)[1]


def _signature(fn: Callable) -> tuple[list[type], type | None]:
    """(argtypes, restype) from a declaration's annotations."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params = list(inspect.signature(fn).parameters)[1:]  # after self
    return [_ctypes_of(hints[p]) for p in params], _ctypes_of(hints["return"])


# name (without llmserve_) -> (argtypes, restype), for every declared C function
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    name: _signature(member) for name, member in vars(Kernels).items()
    if inspect.isfunction(member) and not name.startswith("_")
}
