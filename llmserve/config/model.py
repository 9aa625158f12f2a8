"""A model's shape and options (`ModelConfig`), read from a Hugging Face config.json or GGUF
metadata and checked before anything is allocated."""

import math
from dataclasses import dataclass, field, replace
from typing import Any

from llmserve.config.vision import VISION_ARCHITECTURES, VisionConfig
from llmserve.errors import UnsupportedModelError

# Hugging Face `model_type` values llmserve runs: the Llama family (`models/llama.py`; Phi-3
# with its fused projections and LongRoPE), its mixtures of experts (`models/moe.py`), and
# Gemma 2 and 3 (`models/gemma3.py`, text-only checkpoints).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                           "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Hugging Face `model_type` spellings of a supported architecture.
ARCHITECTURE_ALIASES = {"gemma3_text": "gemma3"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Sanity bounds on what a config makes llmserve allocate beyond the weights the loaders
# check against the file: per-layer tables (before any weight is seen), and the rotary
# cos/sin tables of max_position_embeddings x head_dim values, at most this many or as many
# as the model has weights (Llama 3.1: 131072 x 128 = 2**24; Qwen2.5-7B-1M: 2**27 for 7e9
# weights). A corrupt or hostile file is refused, not given gigabytes.
MAX_NUM_LAYERS = 1 << 16
MAX_ROTARY_TABLE = 1 << 24
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder, in Hugging Face `config.json` terms.

    Per layer: `sliding_windows[i]` is the attention window of layer i (a query sees the
    last `window` positions, itself included; 0: every position) and
    `rope_local_theta`, when set, is the rotary base of the windowed layers (Gemma 3's
    local layers). `attention_scale` overrides head_dim ** -0.5; the soft-caps (Gemma)
    squash attention scores and final logits as cap * tanh(x / cap).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    hidden_act: str = "silu"
    sliding_windows: tuple[int, ...] = ()  # per layer; empty: no layer is windowed
    rope_local_theta: float | None = None
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # OLMoE: q and k RMS-normed over all heads at once (not per head), values clipped
    qk_norm_across_heads: bool = False
    clip_qkv: float | None = None
    moe: "MoEConfig | None" = None  # a mixture of experts (`models/moe.py`)
    # M-RoPE (Qwen2.5-VL, Qwen3-VL): the rotary frequencies in sections turned by a
    # token's temporal, row and column positions (an image token's are its place in the
    # image; a text token's are all three its position); Qwen3-VL's interleaved (the
    # frequencies taken t, h, w, t, h, w, ... while the row and column sections last)
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # a vision-language model's image side (`config/vision.py`); the fields above are its
    # decoder's
    vision: VisionConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {self.hidden_act!r} "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
        self._check_values()
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"{len(self.sliding_windows)} sliding windows for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear", "longrope", "su"):
                raise UnsupportedModelError(f"unsupported rope_scaling type '{kind}'")
            if kind in ("longrope", "su"):
                _check_longrope(self.rope_scaling, self.head_dim)
            numbers = ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")
            for name in numbers if kind in ("llama3", "linear") else ():
                value = self.rope_scaling.get(name)
                if (value is not None or name == "factor") and not _is_positive(value):
                    raise ValueError(f"rope_scaling {name} must be a positive number, "
                                     f"got {value!r}")
        if self.mrope_section is not None and (
                not isinstance(self.mrope_section, tuple) or len(self.mrope_section) != 3
                or not all(_is_int(n) and n > 0 for n in self.mrope_section)
                or sum(self.mrope_section) != self.head_dim // 2):
            raise ValueError(f"mrope_section must be three positive numbers adding up to "
                             f"half the head size ({self.head_dim // 2}), got "
                             f"{self.mrope_section!r}")

    def _check_values(self) -> None:
        """Types and ranges of the numbers, which come from untrusted files: a ValueError
        naming the field, before anything is sized by them."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_hidden_layers > MAX_NUM_LAYERS:
            raise ValueError(f"num_hidden_layers {self.num_hidden_layers} is beyond any "
                             f"model's (at most {MAX_NUM_LAYERS})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings turn pairs of "
                             f"values), got {self.head_dim}")
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        layer = self.hidden_size * (2 * q_size + 2 * kv_size + 3 * self.intermediate_size)
        weights = self.vocab_size * self.hidden_size + self.num_hidden_layers * layer
        if self.max_position_embeddings * self.head_dim > max(MAX_ROTARY_TABLE, weights):
            raise ValueError(
                f"max_position_embeddings {self.max_position_embeddings} x head_dim "
                f"{self.head_dim} is beyond any model's (rotary tables of more values than "
                f"{MAX_ROTARY_TABLE} and than the model's {weights} weights)")
        if not _is_number(self.rms_norm_eps) or self.rms_norm_eps < 0:
            raise ValueError(f"rms_norm_eps must be a number >= 0, got {self.rms_norm_eps!r}")
        positive = {"rope_theta": self.rope_theta, "rope_local_theta": self.rope_local_theta,
                    "attention_scale": self.attention_scale,
                    "attn_logit_softcapping": self.attn_logit_softcapping,
                    "final_logit_softcapping": self.final_logit_softcapping}
        for name, value in positive.items():
            if (value is not None or name == "rope_theta") and not _is_positive(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not all(_is_int(w) and w >= 0 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be integers >= 0, got {self.sliding_windows}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be an object, got {self.rope_scaling!r}")
        if self.clip_qkv is not None and not _is_positive(self.clip_qkv):
            raise ValueError(f"clip_qkv must be a positive number, got {self.clip_qkv!r}")
        if self.moe is not None:
            self.moe.check(self.num_hidden_layers)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: unwindowed)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts (else the dense MLP)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dictionary (a bad value: ValueError)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"the config must be a JSON object, not {type(cfg).__name__}")
        arch = cfg.get("model_type")
        arch = ARCHITECTURE_ALIASES.get(arch, arch) if isinstance(arch, str) else arch
        if arch in VISION_ARCHITECTURES and (arch != "gemma3" or "text_config" in cfg):
            return cls._vision_language(cfg)  # (a text-only Gemma 3 has no text_config)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        heads, hidden = _hf_size(cfg, "num_attention_heads"), _hf_size(cfg, "hidden_size")
        _hf_size(cfg, "num_hidden_layers")
        if not cfg.get("head_dim") and hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads "
                             f"{heads}, and there is no head_dim")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_local_theta = cfg.get("rope_local_base_freq")
        rope_params = cfg.get("rope_parameters")  # newer transformers nest rope settings here
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            # per layer type (Gemma 3): the global layers' rope, and the local layers' base
            local = rope_params.get("sliding_attention") or {}
            if not isinstance(local, dict):
                raise ValueError(f"rope_parameters.sliding_attention must be an object, "
                                 f"got {local!r}")
            rope_local_theta = local.get("rope_theta", rope_local_theta)
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError("unsupported rope scaling on sliding-window layers")
            rope_params = rope_params["full_attention"]
        partial = (rope_params if isinstance(rope_params, dict) else cfg).get(
            "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"unsupported partial rotary embedding "
                                        f"(partial_rotary_factor {partial})")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        mrope_section = None
        for rope in (rope_scaling, rope_params):  # Qwen2.5-VL's M-RoPE, plain rope besides
            if isinstance(rope, dict) and "mrope_section" in rope:
                section = rope["mrope_section"]
                mrope_section = tuple(section) if isinstance(section, list | tuple) \
                    else section
                if rope is rope_scaling:
                    rest = {k: v for k, v in rope.items() if k not in (
                        "mrope_section", "mrope_interleaved", "type", "rope_type",
                        "rope_theta")}
                    kind = rope.get("rope_type", rope.get("type", "default"))
                    rope_scaling = None if kind in ("mrope", "default") and not rest \
                        else rope_scaling
        gemma = arch in GEMMA_ARCHITECTURES
        if arch == "gemma3" and rope_local_theta is None:
            rope_local_theta = 10000.0
        if arch == "gemma2":  # local and global layers share one rotary base
            rope_local_theta = rope_theta if rope_theta is not None else 10000.0
        if isinstance(rope_scaling, dict) and rope_scaling.get(
                "rope_type", rope_scaling.get("type")) in ("longrope", "su"):
            # Phi-3: the pre-training context sits beside the factors (or in the config)
            rope_scaling = {"original_max_position_embeddings": cfg.get(
                "original_max_position_embeddings"), "max_position_embeddings": cfg.get(
                "max_position_embeddings"), **rope_scaling}
        hidden_act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        scalar = cfg.get("query_pre_attn_scalar") if gemma else None
        if scalar is not None and not _is_positive(scalar):
            raise ValueError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", arch in (
                "qwen2", "qwen2_moe"))),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            hidden_act=hidden_act,
            sliding_windows=hf_sliding_windows(cfg, arch),
            rope_local_theta=rope_local_theta if gemma else None,
            attention_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            qk_norm_across_heads=arch == "olmoe",
            clip_qkv=cfg.get("clip_qkv") if arch == "olmoe" else None,
            moe=MoEConfig.from_hf_config(cfg, arch) if arch in MOE_ARCHITECTURES else None,
            mrope_section=mrope_section,
            # a classifier's label names (the pooling runner's /classify)
            extra={"id2label": cfg["id2label"]} if isinstance(cfg.get("id2label"), dict)
            else {},
        )

    @classmethod
    def _vision_language(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """A vision-language checkpoint: the decoder from `text_config` (Llama, Gemma 3's
        with its tied head unless it says otherwise, Qwen2.5-VL's Qwen2 with M-RoPE), the
        image side from the rest."""
        text = cfg.get("text_config")
        qwen3 = cfg.get("model_type") == "qwen3_vl"
        qwen = cfg.get("model_type") == "qwen2_5_vl" or qwen3
        if text is None and qwen:  # transformers 4.x: the decoder's fields at the top
            text = {k: v for k, v in cfg.items() if k not in (
                "vision_config", "model_type", "architectures")}
        if not isinstance(text, dict):
            raise ValueError("text_config must be an object")
        gemma3 = cfg.get("model_type") == "gemma3"
        text = {"model_type": "gemma3_text" if gemma3 else "llama", **text}
        if qwen:  # (their own text model_types: Qwen2 / Qwen3 decoders with M-RoPE)
            text["model_type"] = "qwen3" if qwen3 else "qwen2"
        if qwen3:  # transformers' Qwen3-VL turns interleaved sections, [24, 20, 20] unsaid
            text = _with_mrope_section(text, (24, 20, 20))
        if "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", gemma3)
        decoder = cls.from_hf_config(text)
        vision = VisionConfig.from_hf_config(cfg)
        if qwen and decoder.mrope_section is None:
            rope = text.get("rope_parameters", text.get("rope_scaling"))
            raise UnsupportedModelError(f"a {'Qwen3-VL' if qwen3 else 'Qwen2.5-VL'} decoder "
                                        f"without M-RoPE's mrope_section (rotary parameters "
                                        f"{rope!r})")
        if qwen3:
            decoder = replace(decoder, mrope_interleaved=True)
        if vision.merged and vision.out_hidden_size != decoder.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size {vision.out_hidden_size} is not "
                             f"the decoder's hidden_size {decoder.hidden_size}")
        if vision.image_token_id >= decoder.vocab_size:
            raise ValueError(f"image_token_id {vision.image_token_id} is outside the "
                             f"vocabulary ({decoder.vocab_size} tokens)")
        return replace(decoder, vision=vision)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts: each token's MLP is the weighted sum of `top_k` of
    `num_experts` gated MLPs of width `intermediate_size`, chosen by a linear router's
    softmax (renormalised over the chosen ones when `norm_topk_prob`: Mixtral, Qwen3-MoE;
    not: OLMoE, Qwen2-MoE), plus a shared expert of width `shared_intermediate_size` behind
    a sigmoid gate where the family has one (Qwen2-MoE). Layers in `dense_layers`, and
    those off every `sparse_step`-th, keep the dense MLP (`intermediate_size` of the
    model)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def check(self, num_layers: int) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "sparse_step"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} of the experts must be a positive integer, "
                                 f"got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds num_experts "
                             f"{self.num_experts}")
        if not _is_int(self.shared_intermediate_size) or self.shared_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an integer >= 0, "
                             f"got {self.shared_intermediate_size!r}")
        if not all(_is_int(i) and 0 <= i < num_layers for i in self.dense_layers):
            raise ValueError(f"mlp_only_layers must be layer numbers below {num_layers}, "
                             f"got {list(self.dense_layers)}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got "
                             f"{self.norm_topk_prob!r}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], arch: str) -> "MoEConfig":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        # Mixtral's experts are as wide as its config's intermediate_size and always
        # renormalised; the others name their experts' width
        width = cfg.get("moe_intermediate_size") if arch in ("qwen2_moe", "qwen3_moe") \
            else cfg.get("intermediate_size")
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise ValueError(f"mlp_only_layers must be a list, got {dense!r}")
        return cls(
            num_experts=experts, top_k=cfg.get("num_experts_per_tok"), intermediate_size=width,
            norm_topk_prob=True if arch == "mixtral" else cfg.get("norm_topk_prob", False),
            shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
            if arch == "qwen2_moe" else 0,
            sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            dense_layers=tuple(dense))


def _with_mrope_section(text: dict[str, Any], default: tuple[int, ...]) -> dict[str, Any]:
    """A Qwen3-VL `text_config` whose rotary parameters say `mrope_section` (the default
    transformers turns where they do not) and a base (transformers' 500,000 unsaid)."""
    rope = text.get("rope_parameters")
    key = "rope_parameters" if isinstance(rope, dict) or not isinstance(
        text.get("rope_scaling"), dict) else "rope_scaling"
    rope = text.get(key) or {}
    if not isinstance(rope, dict):
        return text  # refused by name where it is read
    rope = dict(rope)
    rope.setdefault("mrope_section", list(default))
    rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope and "rope_theta" not in text:
        rope["rope_theta"] = 500000.0
    return {**text, key: rope}


def _check_longrope(scaling: dict[str, Any], head_dim: int) -> None:
    """Phi-3's LongRoPE: a short and a long factor per frequency (head_dim / 2 each) and
    the pre-training context they switch at."""
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if (not isinstance(factors, list) or len(factors) != head_dim // 2
                or not all(_is_positive(f) for f in factors)):
            raise ValueError(f"rope_scaling {name} must be {head_dim // 2} positive numbers")
    if not _is_int(scaling.get("original_max_position_embeddings")) or \
            scaling["original_max_position_embeddings"] < 1:
        raise ValueError("rope_scaling original_max_position_embeddings must be a positive "
                         "integer")
    for name in ("factor", "attention_factor"):
        if scaling.get(name) is not None and not _is_positive(scaling[name]):
            raise ValueError(f"rope_scaling {name} must be a positive number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _is_positive(value: Any) -> bool:
    return _is_number(value) and value > 0


def _hf_size(cfg: dict[str, Any], name: str) -> int:
    """A positive integer field of config.json, checked before anything is sized by it."""
    value = cfg[name]
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if name == "num_hidden_layers" and value > MAX_NUM_LAYERS:
        raise ValueError(f"num_hidden_layers {value} is beyond any model's "
                         f"(at most {MAX_NUM_LAYERS})")
    return value


def hf_sliding_windows(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's attention window from a Hugging Face config (empty: none windowed).

    `layer_types` names them where the config has it; otherwise Gemma 3 windows five
    layers of every six (`sliding_window_pattern`), Mistral every layer when
    `sliding_window` is set, and Qwen2/3 the layers from `max_window_layers` on when
    `use_sliding_window` is true; Gemma 2 every other layer from the first."""
    window = cfg.get("sliding_window")
    num_layers = _hf_size(cfg, "num_hidden_layers")
    if not window:
        return ()
    if not _is_int(window) or window < 0:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return ()
    types = cfg.get("layer_types")
    if types is None:
        if arch in GEMMA_ARCHITECTURES:
            pattern = cfg.get("sliding_window_pattern", 6 if arch == "gemma3" else 2)
            if not _is_int(pattern) or pattern < 1:
                raise ValueError(f"sliding_window_pattern must be a positive integer, "
                                 f"got {pattern!r}")
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(num_layers)]
        elif arch in ("qwen2", "qwen3"):
            first = cfg.get("max_window_layers", num_layers)
            if not _is_number(first):
                raise ValueError(f"max_window_layers must be an integer, got {first!r}")
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    if not isinstance(types, list):
        raise ValueError(f"layer_types must be a list, got {types!r}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
