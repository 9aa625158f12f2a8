"""What a loader returns: the model config, its weights under canonical names, file metadata.

Canonical weight names are Hugging Face Llama names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), whatever the file
format; `lm_head.weight` is absent when the embeddings are tied.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.config.model import ModelConfig
from llmserve.errors import ModelFormatError, ModelNotFoundError
from llmserve.models.qwen_vision import merged_tower
from llmserve.models.vision import VisionTower, projector_class
from llmserve.models.vision_language import UNUSED_PREFIXES

# (config, canonical tensor name) -> (rows, columns) to read; None: the whole dimension
WeightSlices = Callable[[ModelConfig, str], tuple[slice | None, slice | None]]


def not_held(rows: slice | None) -> bool:
    """Rows `slice(0, 0)`: the rank holds nothing of the tensor (another rank's expert,
    another pipeline stage's layer): it is not read at all."""
    return rows is not None and rows.start == 0 and rows.stop == 0


@dataclass
class LoadedWeights:
    """A model's config and its dense weights, keyed by canonical (HF Llama) names.

    `metadata` is format-specific: the GGUF key/value metadata (tokenizer, chat template)
    for a GGUF file, the parsed `config.json` for a Hugging Face folder.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    # the kernels that keep the file's quantization ("int4" for GGUF Q4_*, "int8" for other
    # quantized files), None for float weights
    quantization: str | None = None
    # matrices as stored (canonical name -> blocks), for the kernels on a file's own blocks
    blocks: dict[str, Any] = field(default_factory=dict)
    # the names among `blocks` that were not dequantized: they run on their blocks alone
    blocks_only: set[str] = field(default_factory=set)
    # a sequence classifier's head (`score.weight`, (labels, hidden)), kept out of the model
    classifier: torch.Tensor | None = None
    # False: the checkpoint has no LM head (a bare decoder or a classifier; the config was
    # built tied, so the model holds the embedding as its head); it runs pooling only
    has_lm_head: bool = True


def require_path(path: str | Path, *, is_dir: bool) -> Path:
    """Return `path` as a Path, or raise ModelNotFoundError if it is not a file/folder."""
    path = Path(path)
    exists = path.is_dir() if is_dir else path.is_file()
    if not exists:
        kind = "folder" if is_dir else "file"
        raise ModelNotFoundError(f"model {kind} not found: {path}")
    return path


def drop_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """With tied embeddings the head *is* the embedding: keep one copy, under its name."""
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """A gated MLP's weights (`prefix` + gate_proj / up_proj / down_proj)."""
    return {f"{prefix}gate_proj.weight": (inter, hidden),
            f"{prefix}up_proj.weight": (inter, hidden),
            f"{prefix}down_proj.weight": (hidden, inter)}


def layer_shapes(config: ModelConfig, layer_index: int = 0, dense: bool = False
                 ) -> dict[str, tuple[int, ...]]:
    """The shape of each weight of decoder layer `layer_index` (names after
    `model.layers.{i}.`); a mixture-of-experts layer has a router (`mlp.gate`), its experts
    (`mlp.experts.{e}.*`) and, in some families, a shared expert behind a gate. `dense`:
    the layer as if its MLP were the dense one."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
    }
    moe = config.moe
    if moe is not None and not dense and moe.is_sparse(layer_index):
        layer["mlp.gate.weight"] = (moe.num_experts, hidden)
        for e in range(moe.num_experts):
            layer |= mlp_shapes(f"mlp.experts.{e}.", hidden, moe.intermediate_size)
        if moe.shared_intermediate_size:
            layer |= mlp_shapes("mlp.shared_expert.", hidden, moe.shared_intermediate_size)
            layer["mlp.shared_expert_gate.weight"] = (1, hidden)
    else:
        layer |= mlp_shapes("mlp.", hidden, config.intermediate_size)
    if config.architecture == "phi3":  # q/k/v and gate/up stored fused
        for name in ("q_proj", "k_proj", "v_proj"):
            del layer[f"self_attn.{name}.weight"]
        layer["self_attn.qkv_proj.weight"] = (q_size + 2 * kv_size, hidden)
        width = config.intermediate_size
        del layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]
        layer["mlp.gate_up_proj.weight"] = (2 * width, hidden)
    if config.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
                  "self_attn.v_proj.bias": (kv_size,)}
    if config.qk_norm_across_heads:
        layer |= {"self_attn.q_norm.weight": (q_size,), "self_attn.k_norm.weight": (kv_size,)}
    elif config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    if config.architecture in ("gemma2", "gemma3"):
        layer |= {"pre_feedforward_layernorm.weight": (hidden,),
                  "post_feedforward_layernorm.weight": (hidden,)}
    return layer


def image_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A vision-language model's tower and projector tensors (name -> shape), from the
    modules themselves built without memory (empty for a text model)."""
    if config.vision is None:
        return {}
    with torch.device("meta"):
        if config.vision.merged:  # Qwen2.5-VL, Qwen3-VL: the merger is the tower's
            modules = {"vision_tower": merged_tower(config.vision)}
        else:
            projector = projector_class(config.vision)(config.vision, config.hidden_size)
            modules = {"vision_tower": VisionTower(config.vision),
                       "multi_modal_projector": projector}
    return {f"{prefix}.{name}": tuple(p.shape) for prefix, module in modules.items()
            for name, p in module.named_parameters()}


def check_weight_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                        source: str | Path) -> None:
    """Check a checkpoint's tensors (canonical name -> shape, read from its header) against
    its config before any weight is read: every tensor has its place and the shape the
    config implies, and none is missing. So the model built from the config holds no more
    weights than the file, and a corrupt file is named here, not deep in the model."""
    # counted before any layer is listed (a hostile config's layers or experts are many)
    dense = len(layer_shapes(config, dense=True))
    moe = config.moe
    sparse = 0 if moe is None else sum(moe.is_sparse(i) for i in range(config.num_hidden_layers))
    needed = config.num_hidden_layers * dense + (0 if moe is None else sparse * (
        1 + 3 * moe.num_experts - 3 + (4 if moe.shared_intermediate_size else 0)))
    if needed > len(shapes):
        experts = "" if moe is None else f" and {moe.num_experts} experts in {sparse}"
        raise ModelFormatError(f"{source} holds {len(shapes)} tensors, too few for "
                               f"{config.num_hidden_layers} layers of {dense}{experts} "
                               f"({needed})")
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
        "lm_head.weight": (config.vocab_size, config.hidden_size),  # a tied file may have it
    }
    for i in range(config.num_hidden_layers):
        expected |= {f"model.layers.{i}.{name}": shape
                     for name, shape in layer_shapes(config, i).items()}
    expected |= image_shapes(config)
    for name, shape in shapes.items():
        if name.startswith(UNUSED_PREFIXES) and config.vision is not None:
            continue  # a vision tower's pooling head, which its features never read
        if name not in expected:
            raise ModelFormatError(f"{source}: tensor {name!r} has no place in a "
                                   f"{config.num_hidden_layers}-layer {config.architecture} model")
        if tuple(shape) != expected[name]:
            raise ModelFormatError(f"{source}: tensor {name} has shape {tuple(shape)}, the config "
                                   f"implies {expected[name]}")
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [name for name in expected if name not in shapes and name not in optional]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"{source} lacks tensor(s) {', '.join(missing[:3])}{more}")
