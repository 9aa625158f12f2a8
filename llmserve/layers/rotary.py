"""Rotary position embeddings: the cos/sin table, its Llama-3 and linear scalings, M-RoPE's
positions by section (Qwen2.5-VL) or interleaved (Qwen3-VL), and the rotation of q and k
(in place by the native kernel where it runs, not under `torch.compile`)."""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmserve.kernels import native_for, ptr


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent rope scaling: long wavelengths slowed by `factor`."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_freqs(positions: torch.Tensor, exponents: torch.Tensor, base: float,
                    scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its short factor at positions inside
    the pre-training context and by its long factor beyond it, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)) (or the config's `attention_factor`).

    The factors go by position, so a position's rotation is the same in every sequence
    (prefix-cache hits stay exact). Hugging Face switches a whole sequence to the long
    factors once it outgrows the context; the two agree on every sequence that fits it.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (scaling.get("max_position_embeddings") or original) \
        / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) /
                                                        math.log(original))
    powers = base**exponents
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
    freqs = torch.where((positions < original).unsqueeze(1), torch.outer(positions, short),
                        torch.outer(positions, long))
    return freqs, attention


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) with a precomputed cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        mrope_section: tuple[int, ...] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("mrope_rows", None if mrope_section is None else mrope_rows(
            head_dim, mrope_section, mrope_interleaved), persistent=False)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if kind == "linear":
            positions = positions / scaling["factor"]
        freqs = torch.outer(positions, inv_freq)  # (max_position, head_dim/2)
        scale = 1.0
        if kind in ("longrope", "su"):
            freqs, scale = _longrope_freqs(positions, exponents, base, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_position, head_dim)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryPositions":
        """The rotation for one step's tokens, shared by all layers: `positions` (T,), or
        with M-RoPE (3, T), each token's temporal, row and column positions."""
        return RotaryPositions(positions, self.cos_cache, self.sin_cache, dtype,
                               self.mrope_rows)


def mrope_rows(head_dim: int, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """(head_dim,): which of M-RoPE's three position rows (temporal, row, column) turns
    each column of the head. By section (Qwen2.5-VL): the first `section[0]` frequencies
    of each half by the temporal row, the next `section[1]` by the row, the rest by the
    column. Interleaved (Qwen3-VL): frequency j by the row where j % 3 == 1 and j <
    3 x section[1], by the column where j % 3 == 2 and j < 3 x section[2], else by the
    temporal row."""
    half = head_dim // 2
    if interleaved:
        j = torch.arange(half)
        rows = torch.zeros(half, dtype=torch.long)
        rows[(j % 3 == 1) & (j < 3 * section[1])] = 1
        rows[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    return torch.cat([rows, rows])


@dataclass
class RotaryPositions:
    """Rotary tables at one step's positions (T,); cos/sin looked up once, when first used.
    M-RoPE's positions are (3, T): each column of the head turned by the position of its
    row (`mrope_rows`). A token whose three positions are equal (every text token) gets
    the plain rotation at that position, bit for bit."""

    positions: torch.Tensor
    cos_cache: torch.Tensor  # (max_position, head_dim)
    sin_cache: torch.Tensor
    dtype: torch.dtype
    mrope_rows: torch.Tensor | None = None  # (head_dim,) 0, 1 or 2

    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (T, 1, head_dim) in the compute dtype, looked up when first used (the
        native in-place rotation never needs them). Not a `cached_property`: its lock would
        break a `torch.compile` graph. Kept as (T, head_dim): a compiled decoder layer that
        takes them as inputs sees no size-1 dimension to make symbolic."""
        if self._cos_sin is None:
            self.look_up()
        cos, sin = self._cos_sin
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def look_up(self) -> None:
        if self.positions.dim() == 2:
            self._cos_sin = (self._by_section(self.cos_cache), self._by_section(self.sin_cache))
            return
        cos = self.cos_cache[self.positions].to(self.dtype)
        sin = self.sin_cache[self.positions].to(self.dtype)
        self._cos_sin = (cos, sin)

    def _by_section(self, table: torch.Tensor) -> torch.Tensor:
        """(T, head_dim): each column of the head from its row's positions."""
        rows = table[self.positions]  # (3, T, head_dim)
        index = self.mrope_rows.view(1, 1, -1).expand(1, *rows.shape[1:])
        return rows.gather(0, index)[0].to(self.dtype)

    def rotate_qkv_(self, qkv: torch.Tensor, num_rotated_heads: int, head_dim: int) -> bool:
        """Rotate the first `num_rotated_heads` heads (q, then k) of fused qkv rows (T, C)
        in place with the native kernel; False (nothing done) where it cannot run."""
        lib = None if torch.compiler.is_compiling() else native_for(qkv, self.cos_cache)
        if lib is None or qkv.dim() != 2 or self.positions.dtype != torch.long or \
                self.positions.dim() != 1:
            return False
        lib.rotary_inplace(
            ptr(qkv), qkv.shape[0], qkv.shape[1], num_rotated_heads, head_dim,
            ptr(self.positions), ptr(self.cos_cache), ptr(self.sin_cache))
        return True


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: RotaryPositions
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, num_heads, head_dim), k: (T, num_kv_heads, head_dim) rotated by position."""
    cos, sin = rope.cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
