"""Qwen2.5-VL's vision tower: a ViT over an image of any size (its sides multiples of 28
px), with 2-D rotary positions, attention within windows of 8 x 8 patches in most layers
and over the whole image in a few (`full_attention_layers`), RMSNorm and a gated SiLU MLP,
and a merger that turns each 2 x 2 block of patches into one decoder token.

Qwen3-VL's (`Qwen3VisionTower`): the same patches, rotary positions and slices, with
learned positions besides (a square grid, bilinearly interpolated to the image's),
LayerNorms, a plain GELU MLP, attention over the whole image in every layer, and
DeepStack: the outputs of a few layers merged like the last and given to the decoder's
first layers (an image token's row holds them after its embedding).

The processor hands the patches in merge-block order (the four patches of a token one
after another, the tokens in row order); the tower reorders them window by window (each
window's tokens together, so that a window is a run of rows), and the merger's output is
put back in row order. Parameter names follow Hugging Face's
`Qwen2_5_VisionTransformerPretrainedModel` (`visual.` in a checkpoint), under
`vision_tower.`.
"""

import math
from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.vision import VisionConfig
from llmserve.models.vision import SLICE_ROWS, _activation

ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    """x / rms(x) in float32, times the weight in the input's dtype (transformers' order)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class PatchEmbed(nn.Module):
    """A patch's pixels (C x frames x p x p, flat) through a Conv3d the size of a patch."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.shape = (cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size,
                      cfg.patch_size)
        self.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, self.shape[1:],
                              stride=self.shape[1:], bias=cfg.architecture == "qwen3_vl")

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated in float32) and v of rows `x`, each (heads, rows, head_dim)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen3-VL's tower MLP: two biased linears around the activation."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        qwen3 = cfg.architecture == "qwen3_vl"
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6) if qwen3 else \
            RMSNorm(cfg.hidden_size)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6) if qwen3 else \
            RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = PlainMLP(cfg) if qwen3 else VisionMLP(cfg)

    def slices(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               spans: list[tuple[int, int]]) -> Generator[None, None, torch.Tensor]:
        """The block on rows (P, hidden) a slice at a time: q, k and v `SLICE_ROWS` rows
        at a time, then attention within `spans` (the rows that see each other: the
        windows, or the whole image) about `SLICE_PAIRS` query-key pairs at a time, then
        the projection and MLP by rows."""
        heads, rows = self.attn.num_heads, x.shape[0]
        q = x.new_empty(heads, rows, self.attn.head_dim)
        k, v = torch.empty_like(q), torch.empty_like(q)
        for block in _row_blocks(rows):
            q[:, block], k[:, block], v[:, block] = self.attn.heads(
                self.norm1(x[block]), cos[block], sin[block])
            yield
        attended = torch.empty_like(q)
        for group in _attention_slices(spans):
            for (lo, hi), (key_lo, key_hi) in group:
                # batched (4-D): torch's fused CPU attention; 3-D inputs fall back to
                # its math path (a 1,024-patch image's bfloat16 attention 16x slower)
                attended[:, lo:hi] = F.scaled_dot_product_attention(
                    q[None, :, lo:hi], k[None, :, key_lo:key_hi], v[None, :, key_lo:key_hi])[0]
            yield
        attended = attended.transpose(0, 1).reshape(rows, -1)
        out = torch.empty_like(x)
        for block in _row_blocks(rows):
            h = x[block] + self.attn.proj(attended[block])
            out[block] = h + self.mlp(self.norm2(h))
            yield
        return out


def _row_blocks(num_rows: int) -> list[slice]:
    return [slice(lo, min(lo + SLICE_ROWS, num_rows)) for lo in range(0, num_rows, SLICE_ROWS)]


# query x key pairs a slice of attention computes: `SLICE_ROWS` patches' queries against a
# 4,096-patch image's keys (SigLIP-400M's slices, ~50 ms)
SLICE_PAIRS = SLICE_ROWS * 4096

Piece = tuple[tuple[int, int], tuple[int, int]]  # (query rows, the key rows they see)


def _attention_slices(spans: list[tuple[int, int]]) -> list[list[Piece]]:
    """The attention over `spans` (runs of rows that see each other: windows, or the whole
    image) in slices of about `SLICE_PAIRS` query-key pairs: small windows gathered, a
    large span's queries split into blocks that each see all its keys."""
    groups: list[list[Piece]] = [[]]
    pairs = 0
    for lo, hi in spans:
        step = max(16, SLICE_PAIRS // (hi - lo))  # query rows a slice takes of this span
        for start in range(lo, hi, step):
            if pairs >= SLICE_PAIRS:
                groups.append([])
                pairs = 0
            end = min(start + step, hi)
            groups[-1].append(((start, end), (lo, hi)))
            pairs += (end - start) * (hi - lo)
    return groups


class PatchMerger(nn.Module):
    """Each token's 2 x 2 patches (consecutive rows) normed, concatenated and through a
    two-layer GELU MLP to the decoder's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.width = width
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.merger = Qwen3PatchMerger(cfg, postshuffle=False) \
            if cfg.architecture == "qwen3_vl" else PatchMerger(cfg)
        quarter = cfg.hidden_size // cfg.num_attention_heads // 2
        self.register_buffer("inv_freq", 1.0 / ROPE_THETA ** (
            torch.arange(0, quarter, 2, dtype=torch.float) / quarter), persistent=False)

    def slices(self, pixel_values: torch.Tensor, grid: tuple[int, int]
               ) -> Generator[None, None, torch.Tensor]:
        """(1, patches, C x frames x p x p) of an image of `grid` (rows, columns) tokens ->
        (1, rows x columns, out_hidden_size) in row order, a slice at a time (see
        `VisionBlock.slices`)."""
        cfg = self.config
        unit = cfg.spatial_merge_size ** 2
        order, windows = window_order(grid, cfg.window_size // cfg.merged_patch)
        x = self.patch_embed(pixel_values[0])
        x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
        cos, sin = self._rotary(grid, order)
        whole = [(0, x.shape[0])]
        spans = [(lo * unit, hi * unit) for lo, hi in windows]
        yield
        for i, block in enumerate(self.blocks):
            x = yield from block.slices(
                x, cos, sin, whole if i in cfg.full_attention_layers else spans)
        merged = self.merger(x)
        return merged[torch.argsort(order)].unsqueeze(0)

    def _rotary(self, grid: tuple[int, int], order: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) angles, in window order (merge-block order without
        one): (P, head_dim) cos and sin."""
        r, c = patch_places(grid, self.config.spatial_merge_size, order)
        angles = torch.cat([r[:, None].float() * self.inv_freq,
                            c[:, None].float() * self.inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def patch_places(grid: tuple[int, int], m: int, order: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's row and column (P,) in merge-block order (token by token, in row order
    or the tokens' `order`, its m x m patches inside) of an image of `grid` tokens."""
    rows, cols = grid
    r = torch.arange(rows * m).view(rows, m, 1, 1).expand(rows, m, cols, m)
    c = torch.arange(cols * m).view(1, 1, cols, m).expand(rows, m, cols, m)
    r = r.permute(0, 2, 1, 3).reshape(-1, m * m)
    c = c.permute(0, 2, 1, 3).reshape(-1, m * m)
    if order is not None:
        r, c = r[order], c[order]
    return r.reshape(-1), c.reshape(-1)


def window_order(grid: tuple[int, int], side: int
                 ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The tokens of a `grid` (rows, columns) in window order (windows of `side` x `side`
    tokens, row by row; each window's tokens in row order), and each window's run of
    that order (first, end)."""
    rows, cols = grid
    index = torch.arange(rows * cols).view(rows, cols)
    order, windows = [], []
    start = 0
    for top in range(0, rows, side):
        for left in range(0, cols, side):
            window = index[top:top + side, left:left + side].reshape(-1)
            order.append(window)
            windows.append((start, start + len(window)))
            start += len(window)
    return torch.cat(order), windows


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: each token's 2 x 2 patches LayerNormed (each patch, or the four
    side by side: `postshuffle`, the DeepStack mergers'), concatenated and through a
    two-layer GELU MLP to the decoder's width."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.width, self.postshuffle = width, postshuffle
        self.norm = nn.LayerNorm(width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width) if self.postshuffle else x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(QwenVisionTower):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_layers)

    def slices(self, pixel_values: torch.Tensor, grid: tuple[int, int]
               ) -> Generator[None, None, torch.Tensor]:
        """(1, patches, C x frames x p x p) of an image of `grid` (rows, columns) tokens ->
        (1, rows x columns, out_hidden_size x (1 + DeepStack layers)) in row order: each
        token's embedding, then its DeepStack rows, a slice at a time."""
        cfg = self.config
        x = self.patch_embed(pixel_values[0])
        x = x + self._learned_positions(grid).to(x.dtype)
        cos, sin = self._rotary(grid)
        whole = [(0, x.shape[0])]
        yield
        deep = []
        for i, block in enumerate(self.blocks):
            x = yield from block.slices(x, cos, sin, whole)
            if i in cfg.deepstack_layers:  # a slice of its own, as the last merger's
                deep.append(self.deepstack_merger_list[cfg.deepstack_layers.index(i)](x))
                yield
        return torch.cat([self.merger(x), *deep], dim=-1).unsqueeze(0)

    def _learned_positions(self, grid: tuple[int, int]) -> torch.Tensor:
        """(P, hidden) each patch's learned position: the square table bilinearly
        interpolated (corners aligned) to the image's patches, as transformers'
        `get_vision_interpolation_indices_and_weights` computes it."""
        side = math.isqrt(self.config.num_position_embeddings)
        m = self.config.spatial_merge_size
        r, c = patch_places(grid, m)
        h_taps, h_weights = _bilinear_taps(r, grid[0] * m, side)
        w_taps, w_weights = _bilinear_taps(c, grid[1] * m, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weights[:, :, None]).sum(1)


def _bilinear_taps(index: torch.Tensor, size: int, side: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries (of `side`) each of `index` (on an axis of `size`) reads, and
    their weights, corners aligned."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def merged_tower(cfg: VisionConfig) -> QwenVisionTower:
    """The tower of a merged-patch family (`VisionConfig.merged`)."""
    return Qwen3VisionTower(cfg) if cfg.architecture == "qwen3_vl" else QwenVisionTower(cfg)
