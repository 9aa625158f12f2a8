"""Build a ready model and its tokenizer from a model spec (catalog name, .gguf, HF folder)."""

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmserve.config.model import ModelConfig
from llmserve.distributed.parallel import ShardPlan, TensorParallel
from llmserve.distributed.pipeline import PipelineStage
from llmserve.errors import ModelFormatError, UnsupportedModelError
from llmserve.kernels import native
from llmserve.layers.linear import Linear
from llmserve.loader import weight_cache
from llmserve.loader.catalog import ModelSource, resolve_model
from llmserve.loader.gguf import (
    gguf_main_block_type,
    gguf_stored_quantization,
    load_gguf,
    read_gguf_config,
)
from llmserve.loader.hf import load_hf_folder
from llmserve.loader.kernel_choice import (
    KernelChoice,
    cached_choice,
    choose_quantization,
    choose_stream_prefetch,
)
from llmserve.loader.mmproj import Projector, image_tokens, projector_family, read_mmproj
from llmserve.loader.weights import WeightSlices
from llmserve.models.compile import compile_model
from llmserve.models.llama import STACKED_PARAMS
from llmserve.models.registry import model_class
from llmserve.quantization import quantize_model
from llmserve.quantization.kquant import can_pack as can_pack_blocks
from llmserve.quantization.kquant import main_block_type
from llmserve.quantization.packed_float import can_pack, pack_float_model
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    quantization: str | None = None  # what the linear layers actually run ("int8"; None: float)
    classifier: torch.Tensor | None = None  # a sequence classifier's (labels, hidden) head
    has_lm_head: bool = True  # False: a checkpoint without one (pooling runner only)
    # a projector file's preprocessing (multimodal.ImageProcessor); None: the folder's
    image_processor: Any = None


def auto_quantization(stored: str | None, device: torch.device,
                      config: ModelConfig | None = None, block_type: str = "Q4_K"
                      ) -> str | None:
    """What "auto" runs for a checkpoint stored as `stored`: on the CPU with the native
    kernels, its own format or another, by timing them on `config`'s shapes against float32
    (`kernel_choice.py`; without a config, its own format); float elsewhere (other devices,
    no compiler: torch's float GEMM beats torch ops emulating the integer kernels)."""
    return _auto_choice(stored, device, config, block_type)[0]


def decide_auto(spec: str | None, device: str | torch.device) -> str | None:
    """What "auto" runs for model `spec` on `device`, decided before any rank loads it
    (tensor parallelism: one decision, timed while this process runs alone, for every
    rank; timed by each beside the others loading, every rank judged the machine busy and
    none cached it). A Hugging Face folder's stored format is known once loaded: "auto"
    is returned and each rank decides at load, as before."""
    source = resolve_model(spec)
    if source.kind != "gguf":
        return "auto"
    return _gguf_auto_choice(source.path, device, read_gguf_config(source.path))[0]


def _gguf_auto_choice(path: Path, device: str | torch.device, config: ModelConfig
                      ) -> tuple[str | None, KernelChoice | None]:
    """`_auto_choice` for a GGUF file, from its header."""
    return _auto_choice(gguf_stored_quantization(path), torch.device(device), config,
                        gguf_main_block_type(path))


def _auto_choice(stored: str | None, device: torch.device, config: ModelConfig | None,
                 block_type: str) -> tuple[str | None, KernelChoice | None]:
    """`auto_quantization`, and the timed or cached decision behind it (None: none)."""
    if stored is None or device.type != "cpu" or native() is None:
        return None, None
    if config is None:
        return stored, None
    choice = choose_quantization(stored, config, block_type)
    if choice is None:
        return stored, None
    # a busy start's own format may be slower than what a quiet one picks: said louder
    logger.log(logging.WARNING if choice.source == "busy" else logging.INFO, "%s",
               choice.describe())
    return choice.quantization, choice


def fast_bf16_matmul() -> bool:
    """Whether torch multiplies bfloat16 matrices faster than float32 here: on AMX tiles
    (a 4096 x 1152 by 1152 x 4304 product, 2 threads of a Xeon: 1087 GFLOP/s against 245;
    with AVX512-BF16 alone 193 against 276, on AVX-512 64, on AVX2 22: slower)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False


def load_model(
    spec: str | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    enforce_eager: bool = False,
    tp: TensorParallel | None = None,
    mmproj: str | None = None,
    stage: PipelineStage | None = None,
) -> LoadedModel:
    """Resolve `spec`, read weights and tokenizer, and return the model in eval mode.

    `quantization` ("int8", "int4") repacks the linear layers after loading; None is exact;
    "auto" keeps a quantized checkpoint quantized on the CPU, as llama.cpp does: int4 for
    4-bit GGUF files, int8 for other quantized ones (`auto_quantization`); exact float
    otherwise.
    Float weights get a compiled step unless `enforce_eager` (`models/compile.py`).
    With `tp` (a rank of a tensor-parallel group of size > 1) the model is that rank's
    share, and only that share of each weight is read from the file; with `stage` (a
    pipeline stage, `distributed/pipeline.py`) only its layers (and on stage 0 the
    embedding and the LM head) are built and read.
    A quantized model on the CPU is kept on disk once loaded and mapped from there by the
    next start of the same request (`weight_cache.py`).
    `mmproj`: a projector file (`loader/mmproj.py`) that makes a GGUF decoder a
    vision-language model.
    """
    start = time.perf_counter()
    source = resolve_model(spec)
    staged = stage is not None and stage.size > 1
    sharded = tp is not None and tp.size > 1 or staged
    entry = None
    if mmproj is not None and (source.kind != "gguf" or sharded):
        raise UnsupportedModelError("--mmproj goes with a GGUF model at "
                                    "tensor_parallel_size and pipeline_parallel_size 1 (a "
                                    "Hugging Face folder names its vision tower in its "
                                    "config)")
    if quantization is not None and device_is_cpu(device) and mmproj is None:
        rank = (tp.rank, tp.size) if tp is not None and tp.size > 1 else (0, 1)
        if staged:  # the layers too: a partition or a new measured split loads others
            layers = stage.assign(read_model_config(source)).layers
            rank += (stage.index, stage.size, layers.start, layers.stop)
        entry = weight_cache.entry_for(source, quantization, dtype, device, rank)
    kept = weight_cache.load(entry, (tp, stage)) if entry is not None else None
    if kept is not None:
        if kept["decision_file"] is not None:  # what "auto" chose, said as a start says it
            choice = cached_choice(Path(kept["decision_file"]))
            logger.info("%s", choice.describe() if choice else "auto: the cached decision")
        if staged:
            stage.assign(kept["config"])
        loaded = LoadedModel(kept["model"], kept["tokenizer"], kept["config"], source,
                             kept["quantization"], kept["classifier"], kept["has_lm_head"])
    else:
        loaded, choice = _load_files(source, dtype, device, quantization, tp, mmproj, stage)
        if entry is not None and loaded.quantization is not None and (
                choice is None or choice.source != "busy"):  # a busy choice is not kept
            decision_file = None if choice is None else choice.decision_file
            weight_cache.store(entry, {
                "model": loaded.model, "tokenizer": loaded.tokenizer, "config": loaded.config,
                "quantization": loaded.quantization, "classifier": loaded.classifier,
                "has_lm_head": loaded.has_lm_head,
                "decision_file": None if decision_file is None else str(decision_file)},
                decision_file)
    model, quantization = loaded.model, loaded.quantization
    if quantization is not None and device_is_cpu(device):
        if (prefetch := choose_stream_prefetch(model)) is not None:
            logger.info("%s", prefetch)
    if quantization is None and can_pack(model, dtype):
        pack_float_model(model)  # the exact path on the native float32 GEMM
    if hasattr(model, "enable_native_layers"):
        model.enable_native_layers()
    model.eval()
    # split over ranks the step stays eager: its all-reduces and sends are not traced
    compile_model(model, device, quantization, enforce_eager or sharded)
    logger.info("loaded %s (%s, %s weights) in %.1fs", source.name, source.kind,
                quantization or str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return loaded


def _load_files(source: ModelSource, dtype: torch.dtype, device: str | torch.device,
                quantization: str | None, tp: TensorParallel | None,
                mmproj: str | None = None, stage: PipelineStage | None = None
                ) -> tuple[LoadedModel, KernelChoice | None]:
    """The model read from its files, its linears in their format (not yet enabled for the
    native stack nor compiled), and the kernel decision "auto" followed (None: none)."""
    tp, stage = _split(tp, stage)
    slices = _rank_slices(tp, stage) if tp.size > 1 or stage is not None else None
    from_blocks: frozenset[str] = frozenset()
    choice = None
    projector = None if mmproj is None else read_mmproj(mmproj, dtype)
    if source.kind == "gguf":
        # the model and its linears' format first, from the header: the matrices that run
        # on the file's own blocks are then never dequantized
        config = read_gguf_config(source.path)
        if quantization == "auto":
            quantization, choice = _gguf_auto_choice(source.path, device, config)
        if projector is not None:
            _check_projector_family(config, projector, mmproj, source.path.name)
            config = replace(config, vision=projector.vision)
        model = _new_model(config, tp, device, dtype, stage)

        def on_blocks(blocks: dict) -> set[str]:
            nonlocal from_blocks
            names, from_blocks = blocks_only(model, blocks)
            return names

        weights = load_gguf(source.path, dtype, slices,
                            on_blocks if quantization == "kquant" else None)
        tokenizer = Tokenizer.from_gguf_metadata(weights.metadata)
        if projector is not None:
            if projector.vision.pooled or projector.vision.tiled or projector.vision.merged:
                config = replace(config, vision=image_tokens(
                    config, projector.vision, tokenizer, mmproj))
            weights.config = config
            weights.tensors.update(projector.tensors)
    else:
        weights = load_hf_folder(source.path, dtype, slices)
        tokenizer = Tokenizer.from_hf_folder(source.path)
        model = _new_model(weights.config, tp, device, dtype, stage)
    model.load_weights(weights.tensors, from_blocks)
    weights.tensors.clear()  # the model holds the only copy now: lower peak memory
    if quantization == "auto":
        quantization, choice = _auto_choice(weights.quantization, torch.device(device),
                                            weights.config, main_block_type(weights.blocks))
    quantize_model(model, quantization, linear_blocks(model, weights.blocks))
    if quantization is not None and hasattr(model, "set_tower_dtype") and \
            device_is_cpu(device) and fast_bf16_matmul():
        model.set_tower_dtype(torch.bfloat16)
        logger.info("vision tower: bfloat16 (the CPU's AMX tiles multiply it 4x as fast as "
                    "float32)")
    weights.blocks.clear()  # views of the file: the packed copies are the model's
    classifier = None if weights.classifier is None else weights.classifier.to(device)
    return LoadedModel(model, tokenizer, weights.config, source, quantization, classifier,
                       weights.has_lm_head,
                       None if projector is None else projector.processor), choice


def _check_projector_family(config: ModelConfig, projector: Projector, mmproj: Any,
                            decoder: str) -> None:
    """A Qwen-VL projector needs its own family's decoder (M-RoPE; Qwen3-VL's interleaved,
    with as many DeepStack layers as the projector gives rows), every other projector one
    without M-RoPE: a mismatch refused by name."""
    vision = projector.vision
    qwen3 = vision.architecture == "qwen3_vl"
    wants = ("a qwen3vl" if qwen3 else "a qwen2vl") if vision.merged else "another family's"
    if (config.mrope_section is not None) != vision.merged or (
            vision.merged and config.mrope_interleaved != qwen3):
        raise ModelFormatError(f"{mmproj} is a {projector_family(projector)} projector; it "
                               f"needs {wants} decoder, not {decoder}")
    layers = config.extra.get("deepstack_layers", 0)
    if qwen3 and layers != len(vision.deepstack_layers):
        raise ModelFormatError(f"{mmproj} gives {len(vision.deepstack_layers)} DeepStack "
                               f"rows an image token; {decoder} adds {layers} "
                               f"(qwen3vl.n_deepstack_layers)")


def _split(tp: TensorParallel | None, stage: PipelineStage | None
           ) -> tuple[TensorParallel, PipelineStage | None]:
    """A rank's tensor-parallel group (size 1: none) and pipeline stage (None: none)."""
    return tp or TensorParallel(), stage if stage is not None and stage.size > 1 else None


def _new_model(config: ModelConfig, tp: TensorParallel, device, dtype,
               stage: PipelineStage | None = None) -> nn.Module:
    """The model for `config` (a rank's share under `tp` and `stage`), its weights not yet
    loaded (allocated, untouched: a weight the file's blocks replace never takes memory)."""
    plan = shard_plan(config, tp, stage) if tp.size > 1 or stage is not None else None
    with torch.device(device):
        model = model_class(config)(config, plan)
    return model.to(dtype=dtype)


def blocks_only(model: nn.Module, blocks: dict) -> tuple[set[str], frozenset[str]]:
    """The file tensors (by canonical name) that run on their blocks alone under "kquant"
    (every part of their linear packs, `quantize_model`), and the model parameters they
    replace."""
    names: set[str] = set()
    params: set[str] = set()
    for linear, keys in _linear_block_keys(model, blocks).items():
        if can_pack_blocks([blocks[key] for key in keys]):
            names.update(keys)
            params.add(keys[0] if linear in ("lm_head", "embed_tokens") else f"{linear}.weight")
    return names, frozenset(params)


def linear_blocks(model: nn.Module, blocks: dict) -> dict[str, list]:
    """Each linear's file blocks in row order (a fused projection's parts as STACKED_PARAMS
    stacks them), where the file holds every part as raw blocks (`LoadedWeights.blocks`);
    "lm_head": the tied embedding's (an untied head is the linear "lm_head");
    "embed_tokens": an untied embedding's."""
    return {name: [blocks[key] for key in keys]
            for name, keys in _linear_block_keys(model, blocks).items()}


def _linear_block_keys(model: nn.Module, blocks: dict) -> dict[str, list[str]]:
    """`linear_blocks`, as the keys of `blocks`."""
    if not blocks:
        return {}
    parts_of: dict[str, list[str]] = {}
    for part, (fused, _) in STACKED_PARAMS.items():  # in stacking order: q, k, v; gate, up
        parts_of.setdefault(fused, []).append(part)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        keys = [f"{prefix}.{part}.weight" if prefix else f"{part}.weight"
                for part in parts_of.get(leaf, [leaf])]
        if f"{name}.weight" in blocks:  # a file's own fused tensor (Phi-3's qkv, gate_up)
            keys = [f"{name}.weight"]
        if all(key in blocks for key in keys):
            out[name] = keys
    head = next((k for k in ("lm_head.weight", "model.embed_tokens.weight") if k in blocks),
                None)
    if not getattr(model, "holds_head", True):
        return out  # a later pipeline stage: no embedding, no head
    if getattr(model, "lm_head", None) is None and head is not None:
        out["lm_head"] = [head]
    elif "model.embed_tokens.weight" in blocks:  # an untied embedding: its own table
        out["embed_tokens"] = ["model.embed_tokens.weight"]
    return out


def device_is_cpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cpu"


def shard_plan(config: ModelConfig, tp: TensorParallel,
               stage: PipelineStage | None = None) -> ShardPlan:
    """What rank `tp.rank` of a tensor-parallel group (of pipeline stage `stage`) holds of
    a model with `config`."""
    if config.vision is not None and stage is not None:
        raise UnsupportedModelError("vision-language models run with "
                                    "pipeline_parallel_size 1")
    if stage is not None:
        stage.assign(config)
    if tp.size > 1 and (config.architecture == "phi3" or config.qk_norm_across_heads):
        # Phi-3's fused projections are read whole; OLMoE normalises q and k over all heads
        raise UnsupportedModelError(f"{config.architecture} checkpoints run with "
                                    f"tensor_parallel_size 1")
    return ShardPlan.build(tp, config.num_attention_heads, config.num_key_value_heads,
                           config.intermediate_size, config.vocab_size,
                           config.moe.num_experts if config.moe else 0, stage)


def _rank_slices(tp: TensorParallel, stage: PipelineStage | None) -> WeightSlices:
    def slices(config: ModelConfig, name: str) -> tuple[slice | None, slice | None]:
        return shard_plan(config, tp, stage).weight_slices(name, config.head_dim)
    return slices


def read_model_config(source: ModelSource) -> ModelConfig:
    """The model's shape from its config.json or GGUF metadata; no weights are read.

    For GGUF this is the loader's own config builder, so `memory` and the engine's start
    see exactly the config the loader will.
    """
    if source.kind == "hf":
        path = source.path / "config.json"
        try:
            return ModelConfig.from_hf_config(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"cannot read {path}: {e}") from None
        except KeyError as e:
            raise ModelFormatError(f"{path} lacks the field {e}") from None
    from llmserve.loader.gguf import read_gguf_config

    return read_gguf_config(source.path)
