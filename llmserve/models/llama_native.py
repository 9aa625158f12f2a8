"""The Llama decoder stack on int8, int4, K-quant or packed float32 weights as one native call
(`kernels/llama_layers.cpp`): Llama, Mistral, Qwen2/2.5 (qkv biases), Qwen3 (per-head q/k
norms), Phi-3, Gemma 2 and 3 (four norms a layer, tanh-GELU, soft-capped attention, local
layers' own rotary tables).

A mixture-of-experts layer (Qwen2/3-MoE, Mixtral) runs inside the stack as `models/moe.py`'s
one-call layer. Used by `LlamaForCausalLM.forward` when every layer runs the int8, int4
(native layout), K-quant or packed float32 method, on the CPU with the native attention
backend and an fp32 residual stream. The kernels and their order are the per-op path's, so
both paths give identical bits; this one only skips the Python between kernels. The ctypes
structures mirror the C++ ones field by field and are built once per model (weights) and
once per step (attention metadata).
"""

import ctypes
import itertools
import weakref
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from llmserve.kernels import Kernels, native, ptr
from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.layers.attention.native import NativeCPUBackend
from llmserve.layers.kv_cache import KERNEL_KV_DTYPES, KVCache

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


_INT8, _INT4, _FLOAT32, _INT4_A8, _KQUANT = 0, 1, 2, 3, 4  # the C++ `WeightFormat`


class NativeWeight(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("packed", _P), ("row_sums", _P), ("scale", _P),
                ("out_features", _I64), ("in_features", _I64), ("bias", _P)]


class _LlamaLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("mlp_norm", _P),
                ("qkv", NativeWeight), ("o", NativeWeight), ("gate_up", NativeWeight),
                ("down", NativeWeight), ("q_norm", _P), ("k_norm", _P),
                ("key_cache", _P), ("value_cache", _P),
                ("key_scales", _P), ("value_scales", _P), ("window", _I64),
                ("attention_out_norm", _P), ("mlp_out_norm", _P),
                ("cos_table", _P), ("sin_table", _P), ("moe", _P)]


class _LoraLayer(ctypes.Structure):
    _fields_ = [("linears", _P * 4)]  # each linear's LoraSlot array (kernels.h)


class _LoraStep(ctypes.Structure):
    _fields_ = [("slot_of_row", _P), ("num_slots", _I64), ("layers", _P), ("scratch", _P)]


_LINEAR_PATHS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class _LlamaShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("eps", ctypes.c_float),
                ("attention_scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("activation", ctypes.c_int32)]


_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the C++ `Activation`


class _AttentionStep(ctypes.Structure):
    _fields_ = [("positions", _P), ("cos_table", _P), ("sin_table", _P),
                ("slot_mapping", _P), ("block_tables", _P), ("max_blocks", _I64),
                ("query_start", _P), ("context_lens", _P), ("num_seqs", _I64),
                ("block_size", _I64), ("kv_dtype", ctypes.c_int32)]


def _address(obj: ctypes.Structure | ctypes.Array) -> int:
    return ctypes.addressof(obj)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's linears in the order of the C++ `LlamaLayer` fields (a mixture
    layer: qkv and o; its experts are its `native_layer`'s)."""
    attention = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    if _is_mixture(layer):
        return attention
    return (*attention, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _is_mixture(layer: nn.Module) -> bool:
    return hasattr(layer.mlp, "native_layer")


def float_weight(packed) -> NativeWeight:
    """A `PackedFloatWeight` as the native calls read it (a router's)."""
    return NativeWeight(_FLOAT32, ptr(packed.packed), None, None, packed.out_features,
                        packed.in_features)


def packed_weight(linear: nn.Module) -> NativeWeight | None:
    """`linear`'s weight (and bias) as the native layer kernels read them; None where they
    cannot (torch's own float weight, an unpadded int4 layout, a bias not fp32)."""
    weight = _packed_weight(linear)
    bias = linear.bias
    if weight is None or (bias is not None and (bias.dtype != torch.float32
                                                or not bias.is_contiguous())):
        return None
    weight.bias = ptr(bias)
    return weight


def _packed_weight(linear: nn.Module) -> NativeWeight | None:
    from llmserve.quantization.int4 import Int4LinearMethod
    from llmserve.quantization.int8 import Int8LinearMethod
    from llmserve.quantization.kquant import KQuantLinearMethod
    from llmserve.quantization.packed_float import PackedFloatLinearMethod

    method = getattr(linear.method, "base", linear.method)  # under a LoRA wrapper: its own
    # the stack calls the native GEMMs, which read packed weights
    if isinstance(method, Int8LinearMethod) and method.weight.layout == "vnni":
        w = method.weight
        return NativeWeight(_INT8, ptr(w.packed), ptr(w.row_sums), ptr(w.scale),
                             w.out_features, w.in_features)
    if (isinstance(method, Int4LinearMethod) and method.weight.layout == "vnni"
            and method.weight.k_pad == method.weight.in_features):
        w = method.weight
        return NativeWeight(_INT4 if w.activation_bits == 15 else _INT4_A8, ptr(w.packed), None,
                             None, w.out_features, w.in_features)
    if isinstance(method, KQuantLinearMethod):  # `packed`: the segments' struct
        w = method.weight
        return NativeWeight(_KQUANT, w.address, None, None, w.out_features, w.in_features)
    if isinstance(method, PackedFloatLinearMethod):
        w = method.weight
        return NativeWeight(_FLOAT32, ptr(w.packed), None, None, w.out_features,
                             w.in_features)
    return None


class NativeLlamaLayers:
    """The decoder layers of one model as native structures; `forward` runs them all."""

    def __init__(self, model: nn.Module, lib: Kernels) -> None:
        ids = list(model.held_layers)
        self._setup(lib, model.config, self.held(model), ids,
                    [model.config.window(i) for i in ids], model.model.rotary,
                    getattr(model.model, "rotary_local", None), model.model.norm)

    @classmethod
    def for_head(cls, layers: list[nn.Module], first_layer: int, config, rotary: nn.Module
                 ) -> "NativeLlamaLayers | None":
        """A draft head's Llama decoder layers (EAGLE's: the first without its input norm,
        an `nn.Identity`), their K/V in the cache's layers `first_layer`...; None where the
        native call cannot run them (the per-op path then does)."""
        lib = native()
        if (lib is None or config.hidden_act not in _ACTIVATIONS
                or any(packed_weight(m) is None for layer in layers for m in _linears(layer))):
            return None
        stack = cls.__new__(cls)
        stack._setup(lib, config, list(layers),
                     list(range(first_layer, first_layer + len(layers))),
                     [config.window(i) for i in range(len(layers))], rotary, None, None)
        return stack

    def _setup(self, lib: Kernels, cfg, layers: list[nn.Module], layer_ids: list[int],
               windows: list[int], rotary: nn.Module, rotary_local: nn.Module | None,
               final_norm: nn.Module | None) -> None:
        self.lib = lib
        self.config = cfg
        self.layers = layers
        self.layer_ids = layer_ids  # their layers in the KV cache
        self.windows = windows  # their attention windows (0: none)
        self.rotary, self.rotary_local, self.final_norm = rotary, rotary_local, final_norm
        self.shape = _LlamaShape(cfg.hidden_size, cfg.num_attention_heads,
                                 cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                                 cfg.rms_norm_eps, cfg.attention_scale or cfg.head_dim**-0.5,
                                 cfg.attn_logit_softcapping or 0.0,
                                 _ACTIVATIONS[cfg.hidden_act])
        self.weights = []  # per layer: qkv, o, gate_up, down (a mixture's: empty)
        self.mixtures = []  # per layer: its NativeMoe, or None
        for layer in layers:
            mixture = layer.mlp.native_layer() if _is_mixture(layer) else None
            weights = [packed_weight(m) for m in _linears(layer)]
            self.weights.append(weights + [NativeWeight(), NativeWeight()] * (mixture is not None))
            self.mixtures.append(mixture)
        self.k_pad = max(max(m.method.weight.k_pad for layer in layers
                             for m in _linears(layer)),
                         max((m.widest for m in self.mixtures if m is not None), default=0))
        self._cache_ref: weakref.ref | None = None
        self._layers = None

    @staticmethod
    def held(model: nn.Module) -> list[nn.Module]:
        """The decoder layers `model` holds (a pipeline stage's), in order."""
        return [model.model.layers[i] for i in model.held_layers]

    @classmethod
    def build(cls, model: nn.Module) -> "NativeLlamaLayers | None":
        """For a model the fused call can run exactly; None otherwise."""
        lib = native()
        cfg = model.config
        if (lib is None or cfg.qk_norm_across_heads or cfg.clip_qkv is not None
                or cfg.hidden_act not in _ACTIVATIONS):
            return None
        if next(model.parameters()).device.type != "cpu":
            return None
        for layer in cls.held(model):
            if any(packed_weight(m) is None for m in _linears(layer)):
                return None
            if _is_mixture(layer) and layer.mlp.native_layer() is None:
                return None
        return cls(model, lib)

    def _layer_array(self, kv_cache: KVCache) -> ctypes.Array:
        # built once per KV cache object (a weak reference: a new cache may reuse a freed
        # one's addresses, but never a live object's identity; its tensors are never
        # replaced)
        if self._cache_ref is None or self._cache_ref() is not kv_cache:
            layers = self.layers
            array = (_LlamaLayer * len(layers))()
            for n, (i, window, layer, (qkv, o, gate_up, down)) in enumerate(
                    zip(self.layer_ids, self.windows, layers, self.weights, strict=True)):
                cache = kv_cache.layer(i)
                attn = layer.self_attn
                q_norm, k_norm = (None, None) if attn.q_norm is None else (
                    ptr(attn.q_norm.weight), ptr(attn.k_norm.weight))
                if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's four norms
                    mlp_norm = layer.pre_feedforward_layernorm.weight
                    out_norms = (ptr(layer.post_attention_layernorm.weight),
                                 ptr(layer.post_feedforward_layernorm.weight))
                else:
                    mlp_norm, out_norms = layer.post_attention_layernorm.weight, (None, None)
                # Gemma's local layers: their own base
                rotary = self.rotary_local if getattr(layer, "is_local", False) else None
                tables = (None, None) if rotary is None else (ptr(rotary.cos_cache),
                                                              ptr(rotary.sin_cache))
                mixture = self.mixtures[n]
                array[n] = _LlamaLayer(
                    None if isinstance(layer.input_layernorm, nn.Identity)  # EAGLE's first
                    else ptr(layer.input_layernorm.weight), ptr(mlp_norm),
                    qkv, o, gate_up, down, q_norm, k_norm, ptr(cache.key), ptr(cache.value),
                    ptr(cache.key_scales), ptr(cache.value_scales), window,
                    *out_norms, *tables, None if mixture is None else mixture.address)
            self._layers, self._cache_ref = array, weakref.ref(kv_cache)
        return self._layers

    def can_run(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> bool:
        return (isinstance(meta.backend, NativeCPUBackend) and x.dtype == torch.float32
                # M-RoPE's (3, T) positions and Gemma 3's image spans: per op
                and positions.dtype == torch.long and positions.dim() == 1
                and kv_cache.dtype in KERNEL_KV_DTYPES and not meta.image_spans)

    def lora_args(self, step) -> tuple | None:
        """A LoRA step (`lora/manager.py`'s LoRAStep) as the stack's `LoraStep` layers and
        the widest rank; None where an adapter's update is not packed (the per-op path
        then runs the step)."""
        if any(m is not None for m in self.mixtures):
            return None  # the experts' adapters run per op (models/moe.py)
        key = ("layers", id(self))
        if key in step.native_args:  # the same adapters as a step before
            return step.native_args[key]
        layers = (_LoraLayer * len(self.weights))()
        keep, top = [], 0
        for n, i in enumerate(self.layer_ids):
            for j, path in enumerate(_LINEAR_PATHS):
                args = step.native(f"model.layers.{i}.{path}")
                if args is None:
                    return None
                slots, _, rank = args
                keep.append(args)
                top = max(top, rank)
                layers[n].linears[j] = ctypes.addressof(slots)
        step.native_args[key] = (layers, top, keep)
        return step.native_args[key]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, lora_step=None, lora_args=None,
                taps: tuple[tuple[int, ...], list[torch.Tensor]] | None = None,
                norm: bool = True) -> torch.Tensor:
        """x (T, hidden) fp32 embeddings -> hidden states after the last layer and the final
        norm (the norm's own kernel, called here: its module added ~0.05 ms of Python to
        a decode step). `taps` (layer ids, a list): the stack runs in pieces and the list
        gets a copy of the residual stream entering each of those layers (no LoRA).
        `norm=False` (a pipeline stage before the last): the residual stream, unnormed."""
        rotary = self.rotary
        t, s = x.shape[0], self.shape
        x = x.contiguous()
        step = _AttentionStep(
            ptr(positions), ptr(rotary.cos_cache), ptr(rotary.sin_cache),
            ptr(meta.slot_mapping), ptr(meta.block_tables), meta.block_tables.shape[1],
            ptr(meta.query_start_t), ptr(meta.context_lens_t), meta.num_seqs,
            meta.block_size, KERNEL_KV_DTYPES[kv_cache.dtype])
        width = (2 * s.hidden + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
                 + s.num_heads * s.head_dim + 3 * s.intermediate)
        scratch = torch.empty(t * width)
        # the int8 GEMM's workspace (2 Kp bytes + a float per row) or the int4 one's
        # (2 K bytes + 2 floats per group of 32, per row), whichever a layer needs
        qscratch = torch.empty(t * (2 * self.k_pad + self.k_pad // 4 + 4), dtype=torch.uint8)
        layers = self._layer_array(kv_cache)
        lora = None
        if lora_step is not None:  # each linear's updates, after it (kernels/lora.cpp)
            lora_layers, top, _ = lora_args
            widest = max(s.hidden, s.intermediate, s.num_heads * s.head_dim)
            outputs = max((s.num_heads + 2 * s.num_kv_heads) * s.head_dim, 2 * s.intermediate)
            lora_scratch = torch.empty(t * (widest + 2 * top + outputs))
            lora = _LoraStep(ptr(lora_step.slot_of_row), len(lora_step.groups),
                             _address(lora_layers), ptr(lora_scratch))
        tapped = sorted(set(taps[0])) if taps else []
        bounds = [0, *(i for i in tapped if i > 0), len(layers)]
        for start, end in itertools.pairwise(bounds):
            if start in tapped:
                taps[1].append(x.clone())
            self.lib.llama_layers(
                ptr(x), t, _address(self.shape),
                _address(layers) + start * ctypes.sizeof(_LlamaLayer), end - start,
                _address(step), ptr(scratch), ptr(qscratch),
                None if lora is None else _address(lora))
        if not norm:
            return x
        final = self.final_norm
        out = torch.empty_like(x)
        self.lib.rms_norm(ptr(x), t, s.hidden, ptr(final.weight), final.eps, ptr(out))
        return out


class _EagleChain(ctypes.Structure):
    _fields_ = [("fc", NativeWeight), ("lm_head", NativeWeight), ("draft_ids", _P),
                ("draft_embeds", _P), ("shape", _P), ("layers", _P), ("num_layers", _I64),
                ("cos_table", _P), ("sin_table", _P), ("block_size", _I64),
                ("kv_dtype", ctypes.c_int32)]


class NativeEagleChain:
    """An EAGLE-1 head's drafting as one native call (`kernels/llama_layers.cpp`'s
    `llmserve_eagle_draft`): the first pass over the verified rows, then for each sequence
    that drafts the draft LM head, the greedy draft and its chance, and each further step's
    fc and layers, without the Python of a head pass between them. `draft_embeds` (V, C):
    the target's embedding of each draft vocabulary id (a chain step embeds only its
    drafts)."""

    def __init__(self, stack: NativeLlamaLayers, fc: NativeWeight, lm_head: NativeWeight,
                 k_pad: int, draft_ids: torch.Tensor, draft_embeds: torch.Tensor,
                 kv_cache: KVCache) -> None:
        self.stack = stack
        self.kv_cache = kv_cache
        # kept alive while the struct points at them
        self.draft_ids = draft_ids.to(torch.int64).contiguous()
        self.draft_embeds = draft_embeds.to(torch.float32).contiguous()
        self.vocab = len(self.draft_ids)
        self.k_pad = max(k_pad, stack.k_pad)
        rotary = stack.rotary
        self.chain = _EagleChain(
            fc, lm_head, ptr(self.draft_ids), ptr(self.draft_embeds), _address(stack.shape),
            _address(stack._layer_array(kv_cache)), len(stack.layers), ptr(rotary.cos_cache),
            ptr(rotary.sin_cache), kv_cache.block_size, KERNEL_KV_DTYPES[kv_cache.dtype])

    @classmethod
    def build(cls, stack: NativeLlamaLayers | None, fc: nn.Module, lm_head: nn.Module | None,
              draft_ids: torch.Tensor | None, embed: Callable[[torch.Tensor], torch.Tensor],
              kv_cache: KVCache) -> "NativeEagleChain | None":
        """None where the native chain cannot run the head: no native stack, the target's
        own LM head (no draft vocabulary), a linear whose weights the kernels do not read,
        a KV format they do not."""
        if (stack is None or lm_head is None or draft_ids is None
                or kv_cache.dtype not in KERNEL_KV_DTYPES):
            return None
        weights = [packed_weight(fc), packed_weight(lm_head)]
        if any(w is None for w in weights):
            return None
        k_pad = max(m.method.weight.k_pad for m in (fc, lm_head))
        with torch.inference_mode():
            embeds = embed(draft_ids)
        return cls(stack, *weights, k_pad, draft_ids, embeds, kv_cache)

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, query_lens: np.ndarray,
            starts: np.ndarray, block_tables: np.ndarray, wanted: np.ndarray,
            keep_at: np.ndarray, go_on_at: np.ndarray, cut: bool) -> list[list[int]]:
        """The drafts (target ids) of N sequences: embeds and hidden (T, C), the verified
        rows of sequence b, `query_lens[b]` of them from position `starts[b]` (int32,
        int64); block_tables (N, W) int32; wanted (N,) int32, 0 where a sequence only
        writes its rows' K/V; keep_at, go_on_at (N,) float32."""
        t, n, s = len(embeds), len(query_lens), self.stack.shape
        width = (2 * s.hidden + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
                 + s.num_heads * s.head_dim + 3 * s.intermediate)
        scratch = torch.empty(t * (3 * s.hidden + width) + n * (s.hidden + self.vocab))
        qscratch = torch.empty(t * (2 * self.k_pad + self.k_pad // 4 + 4), dtype=torch.uint8)
        most = max(1, int(wanted.max()))
        drafts = np.zeros((n, most), dtype=np.int64)
        embeds, hidden = embeds.float().contiguous(), hidden.float().contiguous()
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        wanted = np.ascontiguousarray(wanted, dtype=np.int32)
        query_lens = np.ascontiguousarray(query_lens, dtype=np.int32)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        self.stack.lib.eagle_draft(
            _address(self.chain), ptr(embeds), ptr(hidden), t, n, query_lens.ctypes.data,
            starts.ctypes.data, tables.ctypes.data, tables.shape[1], wanted.ctypes.data,
            keep_at.ctypes.data, go_on_at.ctypes.data, int(cut), drafts.ctypes.data, most,
            ptr(scratch), ptr(qscratch))
        return [drafts[j, : wanted[j]].tolist() for j in range(n)]
