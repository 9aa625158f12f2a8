"""Vision towers (CLIP and SigLIP ViTs) and the projectors (LLaVA's MLP, Gemma 3's pooled
projection): images to the decoder's embedding rows.

The tower runs on whole images, with plain torch ops in the model's float dtype (its
linears are not quantized: a few hundred MB at most, run once per image). Parameter names
follow Hugging Face's `CLIPVisionModel` / `SiglipVisionModel` under `vision_tower.` and
`LlavaMultiModalProjector` / `Gemma3MultiModalProjector` under `multi_modal_projector.`.
"""

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.vision import VisionConfig

# the patches a slice of a layer's attention or MLP takes (`VisionEncoderLayer.slices`):
# about 50 ms of a 4,096-patch SigLIP-400M layer in bfloat16 on 2 cores
SLICE_ROWS = 1024


def _activation(name: str):
    return {
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
    }[name]


class VisionEmbeddings(nn.Module):
    """Patches (a strided convolution) plus learned positions; CLIP prepends a class token."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size, bias=cfg.tower == "siglip")
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size)) \
            if cfg.has_class_token else None
        self.position_embedding = nn.Embedding(
            cfg.num_patches + int(cfg.has_class_token), cfg.hidden_size)
        # Idefics3's positions of a whole tile's patches: their fractional coordinates
        # bucketed on the table's grid (for a full tile the patch's own index, but computed
        # as transformers computes it, rounding included); None: the table in order
        self.position_ids: torch.Tensor | None
        self.register_buffer("position_ids", bucketed_positions(
            cfg.image_size // cfg.patch_size) if cfg.tiled else None, persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) -> (N, P (+1), hidden)."""
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(weight.dtype))  # (N, hidden, S/p, S/p)
        x = x.flatten(2).transpose(1, 2)  # (N, P, hidden)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        if self.position_ids is not None:
            return x + self.position_embedding(self.position_ids)
        return x + self.position_embedding.weight


def bucketed_positions(side: int) -> torch.Tensor:
    """(side * side,) position ids of a tile of `side` x `side` patches, as Idefics3's
    embeddings compute them for an unpadded tile."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor(side)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every patch's key and value heads, (N, h, T, d) each."""
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def attend(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
               ) -> torch.Tensor:
        """The attention output of `x`'s patches (some of the image's rows, or all), each
        seeing every patch's key."""
        n, t, _ = x.shape
        out = F.scaled_dot_product_attention(self._heads(self.q_proj(x)), keys, values)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        n, t, _ = y.shape
        return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # (N, h, T, d)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = _activation(cfg.hidden_act)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def slices(self, x: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """The layer on (N, T, hidden) a slice at a time: the keys and values, then the
        attention and then the MLP `SLICE_ROWS` patches at a time (a patch's rows never
        depend on the others' beyond its keys)."""
        normed = self.layer_norm1(x)
        keys, values = self.self_attn.keys_values(normed)
        yield
        attended = torch.empty_like(x)
        for rows in _row_blocks(x.shape[1]):
            attended[:, rows] = x[:, rows] + self.self_attn.attend(normed[:, rows], keys,
                                                                    values)
            yield
        out = torch.empty_like(x)
        for rows in _row_blocks(x.shape[1]):
            out[:, rows] = attended[:, rows] + self.mlp(self.layer_norm2(attended[:, rows]))
            yield
        return out


def _row_blocks(num_rows: int) -> list[slice]:
    return [slice(lo, min(lo + SLICE_ROWS, num_rows)) for lo in range(0, num_rows, SLICE_ROWS)]


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTower(nn.Module):
    """The ViT up to the layer whose output the projector reads (`VisionConfig.layers_run`);
    for LLaVA its later layers and `post_layernorm` are loaded with the checkpoint but never
    run (the features are a hidden state), for Gemma 3 and Idefics3 every layer runs and
    the features are `post_layernorm`'s output (SigLIP's `last_hidden_state`)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) \
            if cfg.tower == "clip" else None  # (sic: the checkpoint's name)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, C, S, S) -> the feature layer's hidden states (N, P (+1), hidden)."""
        return run_slices(self.slices(pixel_values))

    def slices(self, pixel_values: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """`forward` a slice at a time: it yields after the embeddings and after each of a
        layer's slices (`VisionEncoderLayer.slices`), and returns the features. The same
        ops in the same order whoever interleaves what between the slices."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        yield
        for layer in self.encoder.layers[: self.config.layers_run]:
            x = yield from layer.slices(x)
        return self.post_layernorm(x) if self.config.normed_output else x


def run_slices(slices: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """A sliced computation's result, its slices run back to back."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


class MultiModalProjector(nn.Module):
    """LLaVA's two-layer MLP from the tower's width to the decoder's."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cfg.hidden_size, text_hidden_size, bias=cfg.projector_bias)
        self.act = _activation(cfg.projector_act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Gemma3Projector(nn.Module):
    """Gemma 3's projector: the tower's (N, P, V) output as a square grid of patches,
    average-pooled to `mm_tokens_per_image` rows, RMS-normed (Gemma's 1 + weight, in
    float32) and multiplied by `mm_input_projection_weight` (V, hidden)."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(cfg.hidden_size, text_hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(cfg.hidden_size))
        self.eps = cfg.layer_norm_eps
        self.side = cfg.image_size // cfg.patch_size
        self.kernel = self.side // int(round(cfg.mm_tokens_per_image ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, width = x.shape
        grid = x.transpose(1, 2).reshape(n, width, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = pooled.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(x.dtype)


class PixelShuffleProjector(nn.Module):
    """Idefics3's connector: a tile's (N, P, V) output regrouped so that each row holds
    `scale_factor` x `scale_factor` neighbouring patches (transformers' `pixel_shuffle`),
    then `proj` (V * scale_factor ** 2 -> hidden, no bias)."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.scale = cfg.scale_factor
        self.proj = nn.Linear(cfg.hidden_size * self.scale ** 2, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, width = x.shape
        side, scale = int(seq ** 0.5), self.scale
        x = x.reshape(n, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(n, side // scale, side // scale, width * scale * scale).permute(0, 2, 1, 3)
        return self.proj(x.reshape(n, seq // scale ** 2, width * scale * scale))


def projector_class(cfg: VisionConfig) -> type[nn.Module]:
    """The module between the tower and the decoder for `cfg`'s family."""
    if cfg.pooled:
        return Gemma3Projector
    return PixelShuffleProjector if cfg.tiled else MultiModalProjector
