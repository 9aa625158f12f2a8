"""What an engine is built from: its device and dtypes, the KV budget, the attention backend,
the other tensor-parallel ranks, the speculator (with its measured step costs), the
pooling runner's pooler, and the KV tier."""

import logging
import os

import torch

from llmserve.config.engine import DEFAULT_KV_OFFLOAD_GIB, DTYPES, EngineConfig
from llmserve.cpu_info import memory_bytes
from llmserve.distributed.pipeline import partition_layers, stage_layers
from llmserve.engine.image_prompts import ImagePrompts
from llmserve.errors import LLMServeError, UnsupportedModelError
from llmserve.executor.abstract import Executor
from llmserve.executor.backends import make_executor
from llmserve.executor.executor import TensorParallelExecutor
from llmserve.executor.ranks import WorkerSpec
from llmserve.kernels import level_of, native, set_num_threads
from llmserve.kv_tier import (
    BlockStore,
    DiskBlockStore,
    HostBlockStore,
    TierLayout,
    code_fingerprint,
    fingerprint_files,
    model_files,
)
from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.kv_cache import KVCache, resolve_kv_cache_dtype
from llmserve.layers.pooler import Pooler
from llmserve.loader.attention_choice import choose_attention
from llmserve.loader.catalog import resolve_model
from llmserve.loader.kernel_choice import stage_costs
from llmserve.loader.model_loader import LoadedModel, decide_auto, read_model_config
from llmserve.memory import parse_size
from llmserve.multimodal.processors import ImageProcessor
from llmserve.spec_decode.cost import measure_step_costs
from llmserve.spec_decode.draft_model import DraftModelProposer
from llmserve.spec_decode.eagle import EagleProposer, eagle_head_folder, num_eagle_layers
from llmserve.spec_decode.medusa import HeadsFormatError, MedusaProposer
from llmserve.spec_decode.proposer import NgramProposer, Proposer
from llmserve.spec_decode.speculator import Speculator
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LLMServeError("device cuda was asked for but no CUDA GPU is available; use cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    name = DTYPES[dtype]
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _TORCH_DTYPES[name]


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold (quantized weights as stored)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = memory_bytes()[1]
    if available is None:
        raise LLMServeError(
            "this system does not say how much memory is free (no /proc/meminfo, psutil not "
            "installed): give --kv-cache-memory (kv_cache_memory) as a size such as 4GiB "
            "rather than a fraction, or pip install psutil")
    return available


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    budget = config.kv_cache_memory
    if isinstance(budget, float):
        return int(budget * free_memory_bytes(device))
    return parse_size(budget)


def attention_backend_name(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                           loaded: LoadedModel) -> str:
    """config's backend; "auto" on the CPU with the native kernels is chosen by timing
    (`attention_choice.choose_attention`) where the KV dtype leaves a choice."""
    name = config.attention_backend
    if name != "auto" or device.type != "cpu" or native() is None:
        return name
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, loaded.quantization,
                                      native_attention=True)
    if kv_dtype == torch.int8:  # only the native kernel reads int8 entries
        return "native"
    choice = choose_attention(loaded.config, kv_dtype)
    logger.log(logging.WARNING if choice.source == "busy" else logging.INFO, "%s",
               choice.describe())
    return choice.backend


def start_ranks(config: EngineConfig, loaded: LoadedModel | None, device: torch.device,
                dtype: torch.dtype) -> tuple[TensorParallelExecutor | None, str | None]:
    """Under tensor parallelism: start (or meet) the other ranks and tell them what to
    load; they load their shares while this rank loads its own. Returns them and the
    weights' format every rank loads ("auto" decided once, here, before they start:
    `decide_auto`); without tensor parallelism (None, the configured format)."""
    pipeline = config.pipeline_parallel_size
    size = config.tensor_parallel_size * pipeline
    quantization = config.weight_quantization
    if size == 1:
        return None, quantization
    if loaded is not None:
        raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 loads its own "
                         "shards; it cannot take an already loaded model")
    # ranks share the machine's cores unless told otherwise
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // size)
    if config.num_threads is None:
        set_num_threads(threads)
    if quantization == "auto":
        quantization = decide_auto(config.model, device)
    # (before any rank starts: a partition that does not fit the model is refused here)
    split = pipeline_split(config.model, pipeline, quantization,
                           config.pipeline_layer_partition) if pipeline > 1 else ()
    executor = make_executor(config.distributed_executor_backend, size, device, threads,
                             pipeline)
    if split:
        executor.stage.layers = split[0]
    executor.stage_split = split
    executor.start_workers(WorkerSpec(config.model, dtype, str(device), quantization, threads,
                                      config.seed, split))
    logger.info("%d ranks (tensor parallel %d x pipeline parallel %d), %d threads each",
                size, config.tensor_parallel_size, pipeline, threads)
    return executor, quantization


def pipeline_split(model: str | None, size: int, quantization: str | None,
                   partition: tuple[int, ...] | None = None) -> tuple[range, ...]:
    """Each stage's layers: `partition`'s counts where given, else by the layers' and the
    LM head's measured time a step in the kernels the model runs
    (`kernel_choice.stage_costs`), else by their parameters."""
    cfg = read_model_config(resolve_model(model))
    if partition is not None:
        split = partition_layers(cfg, partition)
        logger.info("pipeline: layers %s (pipeline_layer_partition)",
                    ", ".join(f"{r.start}-{r.stop - 1}" for r in split))
        return tuple(split)
    costs = stage_costs(cfg, None if quantization == "auto" else quantization)
    split = stage_layers(cfg, size, None if costs is None else costs[:2])
    how = "split by their parameters" if costs is None else (
        f"split by their time a step, {costs[2]}: a layer "
        f"{sum(costs[0]) / len(costs[0]):.2f} ms, the LM head {costs[1]:.2f} ms at the "
        "serving batch")
    logger.info("pipeline: layers %s (%s)",
                ", ".join(f"{r.start}-{r.stop - 1}" for r in split), how)
    return tuple(split)


def speculative_kv_layers(config: EngineConfig, loaded: LoadedModel) -> int:
    """The KV layers speculation adds to the target's cache: an EAGLE head's (its K/V
    follows the target's blocks); refused where that cache is not one engine's alone."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("eagle", "eagle3"):
        return 0
    for name, value in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                        ("pipeline_parallel_size > 1", config.pipeline_parallel_size > 1),
                        ("kv_role", config.kv_role is not None),
                        ("kv_offload", config.kv_offload_dir is not None
                         or config.kv_offload_gib is not None)):
        if value:
            raise ValueError(f"speculative_config: method {spec.method} keeps its head's K/V "
                             f"in the engine's own KV cache and does not run with {name}")
    try:
        return num_eagle_layers(eagle_head_folder(spec, loaded))
    except HeadsFormatError as e:
        raise ValueError(f"speculative_config: {e}") from None


def build_proposer(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                   dtype: torch.dtype, kv_cache: KVCache,
                   attention: AttentionBackend) -> Proposer | None:
    """Where speculative decoding's drafts come from (None: no speculation): prompt
    lookup, Medusa or EAGLE heads on the target's hidden states (an EAGLE head's K/V in
    `kv_cache`'s layers after the target's), or a draft model (`self_draft`: the
    target's checkpoint, quantized) with a KV cache for as many tokens as the target's.
    The runner calls it after each step."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    try:
        if spec.method == "medusa":
            return MedusaProposer.build(spec, loaded, device, dtype)
        if spec.method in ("eagle", "eagle3"):
            return EagleProposer.build(spec, loaded, kv_cache, attention, device, dtype)
    except HeadsFormatError as e:
        raise ValueError(f"speculative_config: {e}") from None
    num_tokens = kv_cache.num_blocks * kv_cache.block_size
    return DraftModelProposer.build(spec, config, loaded, device, num_tokens)


def build_speculator(config: EngineConfig, loaded: LoadedModel, proposer: Proposer | None,
                     executor: Executor) -> Speculator | None:
    """The speculation policy, with a draft token's cost per batch size measured on this
    machine when k adapts (before any request is admitted)."""
    spec = config.speculative_config
    if spec is None or proposer is None:
        return None
    costs = None
    if spec.adaptive:
        executor.calibrate(spec.num_speculative_tokens)
        runner = executor.runner
        costs = measure_step_costs(loaded.model, runner.kv_cache, runner.attention,
                                   spec.num_speculative_tokens, proposer.step_seconds,
                                   chain_step=proposer.chain_step_seconds)
        logger.info("speculative decoding: a draft token costs %s of a step (by batch "
                    "size); k drafts add %s", {b: round(c, 2) for b, c in costs.by_batch.items()},
                    {b: [round(c, 2) for c in by_k] for b, by_k in costs.by_k.items()})
    return Speculator(spec, costs)


def image_prompts(loaded: LoadedModel) -> ImagePrompts | None:
    """How prompts take images on a vision-language model (None: a text model): the image
    token and the folder's preprocessing (a projector file's: its tower's own)."""
    vision = loaded.config.vision
    if vision is None:
        return None
    folder = loaded.source.path if loaded.source.kind != "gguf" else None
    processor = loaded.image_processor or ImageProcessor.for_model(folder, vision)
    return ImagePrompts.build(vision, processor, loaded.tokenizer)


def build_pooler(config: EngineConfig, loaded: LoadedModel) -> Pooler | None:
    """The pooling runner's pooler (None for the generate runner): for `convert` classify,
    the checkpoint's `score` head or the LM head's logits at `classifier_from_token`'s
    tokens. A checkpoint without an LM head runs the pooling runner only."""
    if config.runner != "pooling":
        if not loaded.has_lm_head:
            raise UnsupportedModelError(
                f"{loaded.source.name} has no LM head (an embedding model or a sequence "
                "classifier): serve it with the pooling runner (--runner pooling)")
        return None
    pooler_config = config.pooler_config
    tokens = pooler_config.classifier_from_token
    if config.convert == "classify" and loaded.classifier is None and tokens is None:
        raise ValueError("convert classify needs a classifier: a score head in the "
                         "checkpoint (*ForSequenceClassification) or pooler_config "
                         "classifier_from_token")
    label_ids = None
    if tokens is not None:
        if not loaded.has_lm_head:
            raise ValueError("pooler_config classifier_from_token reads the LM head, which "
                             f"{loaded.source.name} does not have")
        label_ids = [_single_token(loaded.tokenizer, t) for t in tokens]
    return Pooler(pooler_config, loaded.classifier, label_ids, loaded.model.compute_logits)


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"pooler_config classifier_from_token: {text!r} is "
                             f"{len(ids)} tokens, not one")
        token_id = ids[0]
    return token_id


def build_kv_tier(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype,
                  kv_dtype: torch.dtype, block_size: int, num_kv_heads: int,
                  attention: str, device: torch.device) -> BlockStore | None:
    """The prefix cache's second tier: on disk under `kv_offload_dir`, else in host memory
    (`kv_offload_gib` alone), else None. Its layout names everything that decides a
    block's bits, so a restarted engine reads only blocks it would have computed itself."""
    if not config.kv_tier_enabled:
        return None
    lib = native() if device.type == "cpu" else None
    cfg = loaded.config
    layout = TierLayout(
        model=fingerprint_files(model_files(loaded.source.path)),
        dtype=str(dtype).removeprefix("torch."),
        quantization=loaded.quantization or "none",
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        block_size=block_size, num_layers=cfg.num_hidden_layers, num_kv_heads=num_kv_heads,
        head_dim=cfg.head_dim, isa=level_of(lib) if lib is not None else device.type,
        num_threads=torch.get_num_threads(), attention=attention, code=code_fingerprint(),
    )
    gib = config.kv_offload_gib or DEFAULT_KV_OFFLOAD_GIB
    capacity = int(gib * 2**30)
    if config.kv_offload_dir is None:
        return HostBlockStore(layout, capacity, pin=device.type == "cuda")
    return DiskBlockStore(config.kv_offload_dir, layout, capacity)
