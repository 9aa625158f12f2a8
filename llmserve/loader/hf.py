"""Load a Hugging Face model folder: `config.json` plus `*.safetensors` (sharded or not)."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from llmserve.config.model import ModelConfig
from llmserve.errors import ModelFormatError, UnsupportedModelError
from llmserve.loader.hf_quantized import dequantize, quant_scheme, weight_shapes
from llmserve.loader.weights import (
    LoadedWeights,
    WeightSlices,
    check_weight_shapes,
    drop_tied_head,
    not_held,
    require_path,
)
from llmserve.models.vision_language import vision_language_name

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Checkpoint entries that are not weights (buffers older transformers versions saved).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# safetensors dtypes read as weights (cast to the model's dtype)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# a bare decoder's checkpoint (`LlamaModel`, `Qwen3Model`: what embedding models save)
# names its tensors without the `model.` prefix
BARE_PREFIXES = ("layers.", "embed_tokens.", "norm.")
# a sequence classifier's head: (labels, hidden)
CLASSIFIER = "score.weight"


def load_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32,
                   slices: WeightSlices | None = None) -> LoadedWeights:
    """Load a Hugging Face model folder, weights cast to `dtype`; `metadata` is config.json.
    `slices(config, name)` -> (rows, columns) of each tensor to read (a tensor-parallel
    rank's share): only those are read from the safetensors files.

    Raises ModelNotFoundError (no such folder), ModelFormatError (no config.json, no
    safetensors, unreadable files) or UnsupportedModelError (architecture, `.bin` weights).
    """
    folder = require_path(path, is_dir=True)
    hf_config = _read_config(folder)
    try:
        config = ModelConfig.from_hf_config(hf_config)
        scheme = quant_scheme(hf_config)
    except KeyError as e:
        raise ModelFormatError(f"{folder / 'config.json'} lacks the field {e}") from None
    except ValueError as e:
        raise ModelFormatError(f"{folder / 'config.json'}: {e}") from None
    files = _safetensors_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(_safetensors_shapes(file, quantized=scheme is not None))
    if scheme is not None:
        try:
            shapes = weight_shapes(scheme, shapes)
        except ValueError as e:
            raise ModelFormatError(f"{folder}: {e}") from None
    classifier = shapes.pop(CLASSIFIER, None)
    if classifier is not None and (len(classifier) != 2 or classifier[1] != config.hidden_size):
        raise ModelFormatError(f"{folder}: tensor {CLASSIFIER} has shape {classifier}, not "
                               f"(labels, {config.hidden_size})")
    # a decoder without its LM head (an embedding model, a sequence classifier) runs the
    # pooling runner only: the model is built with the embedding as its head
    has_lm_head = "lm_head.weight" in shapes or config.tie_word_embeddings or \
        _is_causal_lm(hf_config)
    if not has_lm_head:
        config = replace(config, tie_word_embeddings=True)
    check_weight_shapes(config, shapes, folder)
    tensors: dict[str, torch.Tensor] = {}
    if scheme is None:
        for file in files:
            tensors.update(_read_safetensors(file, dtype, config, slices))
    else:  # the parts of a linear may sit in different shards: all read, then combined
        for file in files:
            tensors.update(_read_safetensors(file, None, config, None))
        try:
            tensors = dequantize(scheme, tensors)
        except ValueError as e:
            raise ModelFormatError(f"{folder}: {e}") from None
        tensors = {name: _sliced(t, config, name, slices).to(dtype)
                   for name, t in tensors.items()
                   if slices is None or not not_held(slices(config, name)[0])}
    drop_tied_head(config, tensors)
    return LoadedWeights(config=config, tensors=tensors, metadata=hf_config,
                         quantization=None if scheme is None else scheme.stored,
                         classifier=tensors.pop(CLASSIFIER, None), has_lm_head=has_lm_head)


def _sliced(tensor: torch.Tensor, config: ModelConfig, name: str,
            slices: WeightSlices | None) -> torch.Tensor:
    """A tensor-parallel rank's share of a weight already in memory."""
    rows, cols = slices(config, name) if slices is not None else (None, None)
    if rows is None and cols is None:
        return tensor
    if tensor.dim() == 1:
        return tensor[rows or slice(None)]
    return tensor[rows or slice(None), cols or slice(None)]


# Mixtral's names for its mixture -> the canonical (Qwen-MoE) ones
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                 (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def canonical_name(name: str) -> str:
    """A checkpoint tensor's canonical (HF Llama; Qwen-MoE for experts; `vision_language_name` for a
    vision-language model's) name."""
    name = vision_language_name(name)
    name = f"model.{name}" if name.startswith(BARE_PREFIXES) else name
    if ".block_sparse_moe." in name:
        for old, new in MIXTRAL_NAMES:
            name = name.replace(old, new)
    return name


def _is_causal_lm(hf_config: dict[str, Any]) -> bool:
    architectures = hf_config.get("architectures") or []
    return not isinstance(architectures, list) or not architectures or any(
        isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures)


def _read_tensor(f: Any, name: str, config: ModelConfig, slices: WeightSlices | None
                 ) -> torch.Tensor:
    rows, cols = slices(config, canonical_name(name)) if slices is not None else (None, None)
    if rows is None and cols is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    everything = slice(None)
    if len(part.get_shape()) == 1:
        return part[rows or everything]
    return part[rows or everything, cols or everything]


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"not a Hugging Face model folder: no config.json in {folder}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelFormatError(f"cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{config_path} is not a JSON object")
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by the shard index if there is one, else `*.safetensors`."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ModelFormatError(f"cannot read {index}: {e}") from None
        for name in names:
            if not isinstance(name, str) or Path(name).name != name:
                raise ModelFormatError(f"{index}: weight_map names {name!r}, not a file "
                                       f"beside it")
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{folder} lacks weight shard(s) {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if any(folder.glob("pytorch_model*.bin")):
        raise UnsupportedModelError(
            f"{folder} holds pytorch_model.bin weights; only safetensors are supported "
            "(re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise ModelFormatError(f"no *.safetensors weights in {folder}")


def _safetensors_shapes(file: Path, quantized: bool = False) -> dict[str, tuple[int, ...]]:
    """The weights' shapes from a safetensors header (the library checks its offsets and
    sizes against the file); a tensor of another dtype than FLOAT_DTYPES is refused (int32
    too, in a quantized checkpoint: its packed parts)."""
    allowed = FLOAT_DTYPES + (("I32",) if quantized else ())
    try:
        with safe_open(file, framework="pt") as f:
            parts = {name: f.get_slice(name) for name in f.keys()
                     if not name.endswith(IGNORED_SUFFIXES)}
            for name, part in parts.items():
                if part.get_dtype() not in allowed:
                    raise UnsupportedModelError(
                        f"{file}: tensor {name!r} has dtype {part.get_dtype()} (weights are "
                        f"read from {', '.join(FLOAT_DTYPES)})")
            return {canonical_name(name): tuple(part.get_shape())
                    for name, part in parts.items()}
    except (SafetensorError, OSError) as e:
        raise ModelFormatError(f"cannot read {file}: {e}") from None


def _read_safetensors(file: Path, dtype: torch.dtype | None, config: ModelConfig,
                      slices: WeightSlices | None) -> dict[str, torch.Tensor]:
    """The file's tensors under canonical names, cast to `dtype` (None: as stored)."""
    try:
        with safe_open(file, framework="pt") as f:
            return {
                canonical_name(name): _cast(_read_tensor(f, name, config, slices), dtype)
                for name in f.keys()
                if not name.endswith(IGNORED_SUFFIXES) and not (
                    slices is not None and not_held(slices(config, canonical_name(name))[0]))
            }
    except (SafetensorError, OSError) as e:
        raise ModelFormatError(f"cannot read {file}: {e}") from None
