"""The Llama family (Llama 2/3, SmolLM2, Mistral with its sliding window, Qwen2 with qkv
bias, Qwen3 with q/k norm); its layers are shared by Gemma 3 (`gemma3.py`).

`forward` takes a flat batch of tokens from many sequences (prefill chunks and decodes
together), their positions and explicit attention metadata; everything outside attention
(projections, MLP, norms) runs once over all T tokens.
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.layers.attention.backend import AttentionMetadata, attend_within_images
from llmserve.layers.embedding import Embedding
from llmserve.layers.kv_cache import KVCache, LayerKV
from llmserve.layers.linear import Linear
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import RotaryEmbedding, RotaryPositions, apply_rotary
from llmserve.models.llama_native import NativeLlamaLayers
from llmserve.models.mlp import LlamaMLP
from llmserve.models.moe import SparseMoeBlock

# Checkpoint (Hugging Face) projection names fused into one matmul: name -> (fused, shard).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism); the
    o_proj partial sums are all-reduced over the ranks. Layer `layer` attends within its
    sliding window, if the config gives it one."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None, layer: int = 0) -> None:
        super().__init__()
        self.tp = plan.tp if plan is not None else TensorParallel()
        self.num_heads = len(plan.attention.q_heads) if plan else cfg.num_attention_heads
        self.num_kv_heads = len(plan.attention.kv_heads) if plan else cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale or self.head_dim**-0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_logit_softcapping or 0.0
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        # OLMoE normalises q and k over all heads at once, then clips q, k and v
        self.across_heads = cfg.qk_norm_across_heads
        self.clip = cfg.clip_qkv
        norm_q, norm_k = (self.q_size, self.kv_size) if self.across_heads else (
            self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(norm_q, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(norm_k, cfg.rms_norm_eps) if cfg.qk_norm else None

    def shard_rows(self, shard: str) -> slice:
        """Rows of the fused qkv weight holding projection `shard` ('q', 'k' or 'v')."""
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        size = self.q_size if shard == "q" else self.kv_size
        return slice(start, start + size)

    def forward(
        self,
        rope: RotaryPositions,
        x: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        if self.across_heads:
            qkv = self._norm_and_clip_across_heads(qkv)
        # per-head q/k norms and rotation in place where the native kernels run (the
        # decoder stack's kernels, in its order)
        normed = self.q_norm is None or self.across_heads or (
            self.q_norm.heads_(qkv, 0, self.num_heads, self.head_dim)
            and self.k_norm.heads_(qkv, self.num_heads, self.num_kv_heads, self.head_dim))
        rotated = normed and rope.rotate_qkv_(
            qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        # split after the view: a view of the contiguous qkv rows has strides that need no
        # case on T == 1 (which would make torch.compile specialize the graph on it)
        heads = qkv.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if not normed:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated:
            q, k = apply_rotary(q, k, rope)
        out = meta.backend.forward(q, k, v, cache, meta, self.scale, self.window,
                                   self.softcap)  # (T, H, D)
        if meta.image_spans:  # queries of an image that see all of it (Gemma 3)
            attend_within_images(out, q, cache, meta, self.scale, self.window, self.softcap)
        return self.tp.row_parallel(self.o_proj, out.reshape(t, self.q_size))


    def _norm_and_clip_across_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMoE's [q | k | v] rows: q and k RMS-normed whole, then all three clipped."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        qkv = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=1)
        return qkv if self.clip is None else qkv.clamp_(-self.clip, self.clip)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, plan, layer)
        self.mlp = SparseMoeBlock(cfg, plan) if cfg.is_moe_layer(layer) else LlamaMLP(cfg, plan)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: RotaryPositions, x: torch.Tensor, cache: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds: no parameters, never run."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None,
                 held: range | None = None, embeds: bool = True) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
            cfg.mrope_section, cfg.mrope_interleaved)
        vocab = len(plan.vocab) if plan else cfg.vocab_size
        self.embed_tokens = Embedding(vocab, cfg.hidden_size) if embeds else None
        held = range(cfg.num_hidden_layers) if held is None else held
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, plan, i) if i in held
                                    else MissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Parameter names follow Hugging Face, with q/k/v and gate/up fused.

    With a `ShardPlan` (tensor parallelism) the module holds one rank's share: its heads,
    intermediate channels and vocabulary rows (`distributed/parallel.py`); the embedding
    and the logits are assembled over the ranks.
    """

    def __init__(self, cfg: ModelConfig, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.plan = plan if plan is not None and plan.tp.size > 1 else None
        self.stage = plan.stage if plan is not None else None  # pipeline parallelism
        self.model = LlamaModel(cfg, self.plan, self.held_layers, self.holds_head)
        vocab = len(self.plan.vocab) if self.plan else cfg.vocab_size
        self.lm_head = None if cfg.tie_word_embeddings or not self.holds_head else \
            Linear(cfg.hidden_size, vocab)
        self.native_layers: NativeLlamaLayers | None = None  # see enable_native_layers
        self.compiled_layers = None  # set by models/compile.py: one graph for every layer
        # EAGLE-3 (`spec_decode/eagle.py`): the residual stream entering these layers is
        # kept after each forward, side by side, in `aux_hidden` (T, len(aux_layers) x H)
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def enable_native_layers(self) -> None:
        """Run the decoder stack as one native call when the weights allow it (int8, int4,
        a file's own blocks or packed float32 on the CPU); same bits as the per-op path,
        less Python. Not under tensor parallelism: the stack has no all-reduce inside."""
        if self.plan is None:
            self.native_layers = NativeLlamaLayers.build(self)

    @property
    def held_layers(self) -> range:
        """The decoder layers this rank holds (a pipeline stage's; else all)."""
        stage = getattr(self, "stage", None)
        return range(self.config.num_hidden_layers) if stage is None else stage.layers

    @property
    def holds_head(self) -> bool:
        """Whether this rank holds the embedding and the LM head (pipeline stage 0)."""
        stage = getattr(self, "stage", None)
        return stage is None or stage.is_first

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden_size); with M-RoPE
        positions may be (3, T) (a step with image tokens: `worker/mrope.py`).

        `embeds` (a vision-language model's image tokens): (index (K,), rows (K, hidden)),
        rows that replace the embeddings of tokens `index` of the T. Rows (K, hidden x
        (1 + D)) hold D DeepStack rows after the embedding (Qwen3-VL): the d-th is added
        to the tokens' hidden states after layer d."""
        deepstack: tuple[torch.Tensor, ...] = ()
        if embeds is not None and embeds[1].shape[1] > self.config.hidden_size:
            index, rows = embeds
            first, *deepstack = rows.split(self.config.hidden_size, dim=1)
            embeds = (index, first)
        x = self._stage_input(input_ids, embeds)
        # a stage is busy from here: waiting for the previous stage's rows is not (not traced)
        start = time.perf_counter() if self.stage is not None else 0.0
        if not deepstack and (
                native := self._native_stack(x, positions, kv_cache, meta)) is not None:
            return self._stage_output(native, start)
        rope = self.model.rotary.at(positions, x.dtype)
        if self.compiled_layers is not None:
            rope.look_up()  # the tables go into the compiled layer as inputs
        taps = []
        for i in self.held_layers:
            if i in self.aux_layers:
                taps.append(x)
            x = self.model.layers[i](rope, x, kv_cache.layer(i), meta)
            if i < len(deepstack):
                x = x.index_add(0, embeds[0], deepstack[i].to(x.dtype))
        if self.aux_layers:
            self.aux_hidden = torch.cat(taps, dim=-1)
        return self._stage_output(x if self.stage and not self.stage.is_last
                                  else self.model.norm(x), start)

    def _stage_input(self, input_ids: torch.Tensor,
                     embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The embeddings (pipeline stage 0, or no pipeline) or the residual stream the
        previous stage sent."""
        if self.holds_head:
            return self._embed(input_ids, embeds)
        norm = self.model.norm.weight
        return self.stage.receive(input_ids.shape[0], self.config.hidden_size, norm.dtype,
                                  norm.device)

    def _stage_output(self, x: torch.Tensor, start: float) -> torch.Tensor | None:
        """Without a pipeline: `x`. A pipeline stage sends `x` on (the last stage its final
        hidden states, to stage 0) and returns it on the last stage, None elsewhere:
        stage 0 receives the final hidden states once the last stage is done
        (`receive_final`)."""
        stage = self.stage
        if stage is None:
            return x
        stage.send_on(x)
        stage.busy_seconds += time.perf_counter() - start
        return x if stage.is_last else None

    def receive_final(self, num_tokens: int) -> torch.Tensor:
        """Pipeline stage 0: the last stage's final hidden states of the step in flight
        longest (num_tokens, hidden_size)."""
        norm = self.model.norm.weight
        return self.stage.receive_final(num_tokens, self.config.hidden_size, norm.dtype,
                                        norm.device)

    def _native_stack(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                      meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states from the one-call native stack (normed), or None where
        it does not run this step (see `enable_native_layers`; a LoRA step whose
        adapters it cannot take)."""
        native = self.native_layers
        if native is None or not native.can_run(x, positions, kv_cache, meta):
            return None
        lora = getattr(self, "lora_context", None)  # LoRA adapters in this step
        step = lora.step if lora is not None else None
        aux = getattr(self, "aux_layers", ())  # (Gemma 3 borrows this method, taps none)
        if step is not None and aux:
            return None  # the stack runs in pieces for the taps; LoRA's layers run whole
        args = native.lora_args(step) if step is not None else None
        if step is not None and args is None:
            return None
        norm = self.stage is None or self.stage.is_last
        if not aux:
            return native.forward(x, positions, kv_cache, meta, step, args, norm=norm)
        taps: list[torch.Tensor] = []
        out = native.forward(x, positions, kv_cache, meta, taps=(aux, taps), norm=norm)
        self.aux_hidden = torch.cat(taps, dim=-1)
        return out

    def _embed(self, input_ids: torch.Tensor,
               embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Embedding rows, `embeds`' rows in place of theirs (see `forward`); under tensor
        parallelism each rank looks up the ids in its vocabulary range, zeros elsewhere,
        and the ranks' rows are summed."""
        if self.plan is None:
            x = self.model.embed_tokens(input_ids)
            if embeds is not None:
                index, rows = embeds
                x = x.index_copy(0, index, rows.to(x.dtype))
            return x
        local = input_ids - self.plan.vocab.start
        inside = (local >= 0) & (local < len(self.plan.vocab))
        x = self.model.embed_tokens(torch.where(inside, local, torch.zeros_like(local)))
        return self.plan.tp.all_reduce(x.masked_fill(~inside.unsqueeze(1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) fp32 logits (every rank gets all of them
        under tensor parallelism: an all-gather of the vocabulary shards)."""
        if self.lm_head is None:  # tied: the embedding is the head
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.plan is None:
            return logits
        return self.plan.tp.all_gather_rows(logits, list(self.plan.vocab_sizes))

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor],
                     from_blocks: frozenset[str] = frozenset()) -> None:
        """Copy Hugging Face-named tensors in, fusing stacked projections; all must be used,
        and every parameter loaded but `from_blocks` (those the file's blocks replace:
        `quantize_model` drops them unread)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors.items():
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store a copy of the embedding
            name = self._held_name(name)
            if name is None:
                continue  # another rank's expert
            target, rows = self._target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            param = params[target]
            dst = param.data if rows is None else param.data[rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}/{rows}")
        self._check_all_loaded(params, loaded, from_blocks)

    def _held_name(self, name: str) -> str | None:
        """Expert `e` of a mixture is this rank's expert `e - held.start` (all of them
        without tensor parallelism); None: another rank holds it (its expert, or another
        pipeline stage's layer, embedding or head)."""
        if self.stage is not None and not self.stage.holds(name):
            return None
        if ".mlp.experts." not in name:
            return name
        head, rest = name.split(".mlp.experts.", 1)
        expert, tail = rest.split(".", 1)
        held = self.get_submodule(f"{head}.mlp").held
        if int(expert) not in held:
            return None
        return f"{head}.mlp.experts.{int(expert) - held.start}.{tail}"

    def _target(self, name: str) -> tuple[str, slice | None]:
        """Map a checkpoint name to (parameter name, rows of it) honouring STACKED_PARAMS."""
        for ckpt, (fused, shard) in STACKED_PARAMS.items():
            if f".{ckpt}." not in name:
                continue
            target = name.replace(f".{ckpt}.", f".{fused}.")
            owner = self.get_submodule(target.rsplit(".", 2)[0])  # attention or an MLP
            if fused == "qkv_proj":
                rows = owner.shard_rows(shard)
            else:
                size = owner.intermediate_size
                rows = slice(shard * size, (shard + 1) * size)
            return target, rows
        return name, None

    def _check_all_loaded(self, params: dict, loaded: set[str],
                          from_blocks: frozenset[str] = frozenset()) -> None:
        names = {key.split("/")[0] for key in loaded}
        missing = sorted(set(params) - names - from_blocks)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
