"""How an engine runs (`EngineConfig`, `SpeculativeConfig`), and the choices its options
take: frozen dataclasses, validated at construction."""

from dataclasses import dataclass
from typing import Any

from llmserve.config.pooler import CONVERTS, RUNNERS, PoolerConfig

# "auto" keeps a quantized checkpoint quantized: GGUF Q4_* on the int4 kernels, Q5/Q6/Q8
# on the int8 kernels.
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "int4-a8")
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int8")
ATTENTION_BACKEND_CHOICES = ("auto", "native", "flex", "torch")
# queued requests a server admits before answering 429 (`--max-num-waiting`)
DEFAULT_MAX_NUM_WAITING = 1024
# the HTTP edge (a server's and a router's)
DEFAULT_HEADER_TIMEOUT_S = 10.0  # for a request's headers, from its first byte
DEFAULT_BODY_TIMEOUT_S = 30.0  # for its whole body, from the end of its headers
DEFAULT_MAX_CONNECTIONS = 1024  # open connections or requests in flight (503 beyond)
# many models behind one server (`serve --models-dir`): loaded at most (as Ollama on a
# CPU), and how long an idle one stays loaded (Ollama's five minutes)
DEFAULT_MAX_LOADED_MODELS = 3
DEFAULT_KEEP_ALIVE = "5m"
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0  # to compile a request's constraint (the server refuses past it)
# fcfs and priority batch continuously; static runs each admitted batch to completion
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
# how a preempted request's KV comes back (core/preemption.py): by measured cost, always
# recomputed, or always read from the KV tier
PREEMPTION_MODES = ("auto", "recompute", "swap")
# the KV tier's size cap on disk when --kv-offload-gib is not given
DEFAULT_KV_OFFLOAD_GIB = 8.0

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "auto": "auto"}


SPECULATIVE_METHODS = ("ngram", "draft_model", "self_draft", "medusa", "eagle", "eagle3")
# running requests from which speculation stops paying, per method (benchmarks/notes.md;
# Medusa's heads cost little beside the verification, which is prompt lookup's; an EAGLE
# head runs a forward per draft, as a draft model does)
SPEC_CROSSOVER = {"ngram": 2, "draft_model": 8, "self_draft": 8, "medusa": 2, "eagle": 8,
                  "eagle3": 8}
# methods whose `model` is a draft model (a whole checkpoint) or heads on the target
SPEC_MODEL_METHODS = ("draft_model", "medusa", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `speculative_config` terms (`spec_decode/`).

    * `ngram`: prompt lookup, drafts copied from earlier in the sequence
      (`prompt_lookup_min`..`prompt_lookup_max` tokens matched);
    * `draft_model`: a small model with the same tokenizer (`model`) drafts greedily;
    * `self_draft`: the target's own checkpoint on its fast quantized path drafts
      (`draft_quantization`, default the checkpoint's own), the target verifies, so
      `dtype="float32"` output stays token-identical to the reference at close to
      quantized speed;
    * `medusa`: Medusa heads trained for the target (`model`: their folder, Medusa's or
      vLLM's layout) draft from its last hidden state (`spec_decode/medusa.py`);
    * `eagle`: an EAGLE-1 head trained for the target (`model`: its folder; without it
      the head that ships for a catalog model, `eagle.SHIPPED_HEADS`) drafts from the
      target's hidden states with one decoder layer (`spec_decode/eagle.py`);
    * `eagle3`: an EAGLE-3 head (`model`: its folder, the published layout) drafts from
      the target's hidden states entering three of its layers, with its own vocabulary.

    `num_speculative_tokens` is the most drafts per step; with `adaptive`, each request's
    k follows its measured acceptance rate and what a draft token costs here. Speculation
    is off for a step once `disable_by_batch_size` requests run (null: never; "auto": the
    crossover measured for the method, `SPEC_CROSSOVER`). Measured on the default model
    (`llmserve bench spec`, distinct grounded and chat prompts): prompt lookup on the
    default int4 path gained 1.5x at one stream and lost 3-14 % at two to four (verifying
    drafts turns the int4 step compute-bound); self_draft on the float32 path gained
    1.5-1.7x at one and two streams, 1.2x at four, and lost 8 % at eight.
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_quantization: str = "auto"
    disable_by_batch_size: int | str | None = "auto"
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config: num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs 'model' (a model "
                             "with the target's tokenizer)")
        if self.method in ("medusa", "eagle3") and not self.model:
            raise ValueError(f"speculative_config: method {self.method} needs 'model' (the "
                             f"folder of {self.method} heads trained for the target)")
        if self.method not in SPEC_MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative_config: 'model' is for methods "
                             f"{', '.join(SPEC_MODEL_METHODS)}, not {self.method}")
        if self.draft_quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"speculative_config: draft_quantization must be one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}, not "
                             f"{self.draft_quantization!r}")
        if self.disable_by_batch_size == "auto":
            object.__setattr__(self, "disable_by_batch_size", SPEC_CROSSOVER[self.method])
        elif self.disable_by_batch_size is not None and (
                isinstance(self.disable_by_batch_size, str) or self.disable_by_batch_size < 1):
            raise ValueError("speculative_config: disable_by_batch_size must be at least 1 "
                             f"(or null: never, or \"auto\"), got "
                             f"{self.disable_by_batch_size!r}")

    @classmethod
    def from_dict(cls, options: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """From `{"method": ..., ...}` (vLLM's keys); an unknown key is refused by name."""
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        if "method" not in options:
            raise ValueError("speculative_config needs 'method' (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        return cls(**options)


# how the ranks of a tensor-parallel engine are started (executor/executor.py)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher", "ray")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. Defaults serve the default model on this machine.

    `dtype="float32"` is the exact path the reference tests use; "auto" picks float32 on
    the CPU (bf16 is emulated and slow there) and bfloat16 on CUDA.
    `kv_cache_memory` is a size ("2GiB", bytes) or a fraction of the free memory (0.3).
    """

    model: str | None = None
    # a GGUF model's vision projector file (llama.cpp's --mmproj; loader/mmproj.py)
    mmproj: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # None: "auto" with dtype auto (a quantized checkpoint keeps its quantization: int4 or
    # int8 kernels), exact float weights otherwise; "none": always float; "int8": W8A8
    # linear layers; "int4": 4-bit weight groups of 32, two-part int8 activations (15 bits);
    # "int4-a8": the same weights with 8-bit activations (quantization/int4.py)
    quantization: str | None = None
    # auto (CPU, native kernels): int8 on the int8 weight path, bfloat16 on the int4 path;
    # else the compute dtype
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None  # compute threads (torch's intra-op pool); None: all cores
    block_size: int = 16
    kv_cache_memory: str | int | float = "2GiB"
    max_num_seqs: int = 256
    # tokens per step: 512 (llama.cpp's micro-batch) lets the first prompts of a burst
    # start decoding while later ones prefill; measured on the default model, 16 streams:
    # TTFT p50 1364 -> 663 ms, 32 streams 321 -> 372 tok/s against 2048
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    # True: never torch.compile the model step (vLLM's flag); see models/compile.py
    enforce_eager: bool = False
    # auto: native kernels on the CPU, flex_attention on CUDA; or native, flex, torch
    # (layers/attention/selector.py)
    attention_backend: str = "auto"
    # None: no speculative decoding; a SpeculativeConfig or its dict form (vLLM's keys)
    speculative_config: SpeculativeConfig | dict | None = None
    # ranks the model is split over (distributed/): heads, MLP channels and vocabulary
    tensor_parallel_size: int = 1
    # stages the layers are split over (distributed/pipeline.py), each a tensor-parallel
    # group: tensor_parallel_size x pipeline_parallel_size ranks in all
    pipeline_parallel_size: int = 1
    # each stage's number of layers, stage 0 first (vLLM's VLLM_PP_LAYER_PARTITION): hosts
    # of different speeds; None: split by measured cost (distributed/pipeline.py)
    pipeline_layer_partition: tuple[int, ...] | None = None
    # mp: rank 0 spawns the other ranks on this machine; external_launcher: torchrun
    # started every rank (several machines); ray: the other ranks are actors on a Ray
    # cluster, placed by a placement group (executor/ray_executor.py)
    distributed_executor_backend: str = "mp"
    # disaggregated prefill/decode (distributed/kv_transfer.py): "prefill" sends finished
    # prompts' KV to its decode peer, "decode" continues requests from received KV; both
    # meet at kv_transfer_address (HOST:PORT, hosted by the decode side)
    kv_role: str | None = None
    kv_transfer_address: str | None = None
    # "pooling": embeddings, classification and scores only (config/pooler.py); `convert`
    # (embed, classify) says which, `pooler_config` how (a PoolerConfig or its dict/JSON)
    runner: str = "generate"
    convert: str | None = None
    pooler_config: PoolerConfig | dict | str | None = None
    # LoRA adapters (lora/): requests name one (LoRARequest); `max_loras` adapters at most
    # in one step, ranks up to `max_lora_rank`, `max_cpu_loras` kept loaded (None: 16)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the prefix cache's second tier (kv_tier/): full KV blocks kept on local disk under
    # `kv_offload_dir` (kept across restarts), at most `kv_offload_gib` GiB (None: 8); with
    # only `kv_offload_gib`, in host memory (page-locked on CUDA)
    kv_offload_dir: str | None = None
    kv_offload_gib: float | None = None
    # auto: read a preempted request's blocks back from the tier or recompute them, by
    # measured cost; recompute; swap (needs the tier)
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {self.runner!r}")
        if self.convert is not None and self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, not "
                             f"{self.convert!r}")
        if self.convert is not None and self.runner != "pooling":
            raise ValueError("convert (--convert) is for the pooling runner (--runner pooling)")
        object.__setattr__(self, "pooler_config", PoolerConfig.from_value(self.pooler_config))
        if self.runner == "pooling":
            for name, value in (("speculative_config", self.speculative_config),
                                ("kv_role", self.kv_role),
                                ("tensor_parallel_size > 1",
                                 self.tensor_parallel_size > 1 or None),
                                ("pipeline_parallel_size > 1",
                                 self.pipeline_parallel_size > 1 or None)):
                if value is not None:
                    raise ValueError(f"the pooling runner does not support {name}")
        if self.enable_lora:
            for name, value in (("max_loras", self.max_loras),
                                ("max_lora_rank", self.max_lora_rank)):
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or \
                    self.runner == "pooling":
                raise ValueError("enable_lora runs the generate runner at "
                                 "tensor_parallel_size and pipeline_parallel_size 1")
        if (self.kv_role is None) != (self.kv_transfer_address is None):
            raise ValueError("kv_role (--role) and kv_transfer_address (--kv-transfer-address) "
                             "go together")
        if self.kv_role is not None and self.kv_role not in ("prefill", "decode"):
            raise ValueError(f"kv_role must be prefill or decode, not {self.kv_role!r}")
        if self.kv_role is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_role (disaggregated prefill/decode) with "
                             "tensor_parallel_size > 1 is not supported")
        if self.kv_role is not None and self.pipeline_parallel_size > 1:
            raise ValueError("kv_role (disaggregated prefill/decode) with "
                             "pipeline_parallel_size > 1 is not supported")
        self._check_kv_tier()
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        self._check_partition()
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError("distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, not "
                             f"{self.distributed_executor_backend!r}")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                f"not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                f"not {self.kv_cache_dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
                f"not {self.attention_backend!r}")
        if self.kv_cache_dtype == "int8" and self.attention_backend in ("torch", "flex"):
            # checked here, before any weights load (the engine checks the rest after)
            raise ValueError("kv_cache_dtype int8 needs the native CPU attention kernels "
                             f"(attention_backend auto or native), not {self.attention_backend}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", not {self.scheduling_policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], not {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if isinstance(self.kv_cache_memory, float) and not 0 < self.kv_cache_memory <= 1:
            raise ValueError(
                f"kv_cache_memory as a fraction must be in (0, 1], got {self.kv_cache_memory}"
            )

    @property
    def kv_tier_enabled(self) -> bool:
        return self.kv_offload_dir is not None or self.kv_offload_gib is not None

    def _check_partition(self) -> None:
        partition = self.pipeline_layer_partition
        if partition is None:
            return
        partition = tuple(partition)
        object.__setattr__(self, "pipeline_layer_partition", partition)
        if len(partition) != self.pipeline_parallel_size:
            raise ValueError(f"pipeline_layer_partition {list(partition)} needs one layer "
                             f"count per stage: pipeline_parallel_size is "
                             f"{self.pipeline_parallel_size}")
        if not all(isinstance(n, int) and n >= 1 for n in partition):
            raise ValueError(f"pipeline_layer_partition {list(partition)}: every stage "
                             "needs at least one layer")

    def _check_kv_tier(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"not {self.preemption_mode!r}")
        if self.kv_offload_gib is not None and not self.kv_offload_gib > 0:
            raise ValueError(f"kv_offload_gib must be positive, got {self.kv_offload_gib}")
        if not self.kv_tier_enabled:
            if self.preemption_mode == "swap":
                raise ValueError("preemption_mode swap reads KV back from the KV tier: give "
                                 "kv_offload_dir (--kv-offload-dir) or kv_offload_gib")
            return
        if not self.enable_prefix_caching:
            raise ValueError("the KV tier (kv_offload_dir / kv_offload_gib) is the prefix "
                             "cache's second tier: it needs prefix caching on")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) > 1:
                raise ValueError(f"the KV tier (kv_offload_dir / kv_offload_gib) runs at "
                                 f"{name} 1")

    @property
    def weight_quantization(self) -> str | None:
        """What the loader is asked for: "auto" only on the fast default (dtype auto)."""
        if self.quantization is None:
            return "auto" if self.dtype == "auto" else None
        return None if self.quantization == "none" else self.quantization
