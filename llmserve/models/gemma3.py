"""Gemma 3 (text): the Llama layers with Gemma's numerics.

What differs from Llama (`llama.py`, whose attention and MLP it shares):
* the embedding is scaled by sqrt(hidden_size);
* RMSNorm scales by (1 + weight): the checkpoint's weights get their 1 added at load, so
  the norm itself is Llama's;
* four norms per layer: before and after attention, before and after the MLP (the
  "post" norms apply to the sublayer's output, before the residual add);
* q/k RMSNorm per head, attention scaled by query_pre_attn_scalar ** -0.5;
* GeGLU MLP (tanh GELU);
* interleaved layers: local ones attend within a sliding window with their own rotary
  base (`rope_local_theta`), global ones attend to everything with `rope_theta` (and its
  scaling);
* optional soft-capping of attention scores and of the final logits.
"""

import time

import torch
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.embedding import Embedding
from llmserve.layers.kv_cache import KVCache, LayerKV
from llmserve.layers.linear import Linear
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import RotaryEmbedding, RotaryPositions
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, MissingLayer


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, plan, layer)
        self.mlp = LlamaMLP(cfg, plan)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_local = cfg.window(layer) > 0

    def forward(self, rope: RotaryPositions, x: torch.Tensor, cache: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(x), cache, meta)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None,
                 held: range | None = None, embeds: bool = True) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta or cfg.rope_theta)
        vocab = len(plan.vocab) if plan else cfg.vocab_size
        self.embed_tokens = Embedding(vocab, cfg.hidden_size) if embeds else None
        held = range(cfg.num_hidden_layers) if held is None else held
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, plan, i) if i in held
                                    else MissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Decoder + LM head (tied to the embedding in every Gemma 3 release). Parameter names
    follow Hugging Face's Gemma3ForCausalLM, with q/k/v and gate/up fused."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.plan = plan if plan is not None and plan.tp.size > 1 else None
        self.stage = plan.stage if plan is not None else None  # pipeline parallelism
        self.model = Gemma3Model(cfg, self.plan, self.held_layers, self.holds_head)
        vocab = len(self.plan.vocab) if self.plan else cfg.vocab_size
        self.lm_head = None if cfg.tie_word_embeddings or not self.holds_head else \
            Linear(cfg.hidden_size, vocab)
        self.native_layers = None  # see LlamaForCausalLM.enable_native_layers
        self.compiled_layers = None  # set by models/compile.py: one graph for every layer
        self.embed_scale = cfg.hidden_size**0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden_size).

        `embeds` (Gemma 3's image tokens): (index (K,), rows (K, hidden)), rows that replace
        the scaled embeddings of tokens `index` of the T (unscaled, as transformers places
        them)."""
        x = self._stage_input(input_ids)
        # a stage is busy from here: waiting for the previous stage's rows is not (not traced)
        start = time.perf_counter() if self.stage is not None else 0.0
        if self.holds_head:
            # as Hugging Face: the scale rounded to the embedding's dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
            if embeds is not None:
                index, rows = embeds
                x = x.index_copy(0, index, rows.to(x.dtype))
        if (native := self._native_stack(x, positions, kv_cache, meta)) is not None:
            return self._stage_output(native, start)
        ropes = {False: self.model.rotary.at(positions, x.dtype),
                 True: self.model.rotary_local.at(positions, x.dtype)}
        if self.compiled_layers is not None:
            for rope in ropes.values():
                rope.look_up()  # the tables go into the compiled layer as inputs
        for i in self.held_layers:
            layer = self.model.layers[i]
            x = layer(ropes[layer.is_local], x, kv_cache.layer(i), meta)
        return self._stage_output(x if self.stage and not self.stage.is_last
                                  else self.model.norm(x), start)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor],
                     from_blocks: frozenset[str] = frozenset()) -> None:
        """Hugging Face-named tensors; every RMSNorm weight w is stored as 1 + w."""
        shifted = {name: t + 1.0 if name.endswith("norm.weight") else t
                   for name, t in tensors.items()}
        super().load_weights(shifted, from_blocks)
