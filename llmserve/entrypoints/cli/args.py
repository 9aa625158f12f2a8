"""The flags several commands share, the types that parse them, and what they turn into
(sampling options, an `LLM`)."""

import argparse
import json
from typing import TYPE_CHECKING, Any

from llmserve.config.engine import (
    ATTENTION_BACKEND_CHOICES,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPE_CHOICES,
    PREEMPTION_MODES,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
)
from llmserve.config.pooler import CONVERTS, RUNNERS
from llmserve.loader.catalog import DEFAULT_MODEL

if TYPE_CHECKING:
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                  "ignore_eos")
ENGINE_FLAGS = ("mmproj", "dtype", "device", "quantization", "kv_cache_dtype", "num_threads",
                "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "block_size", "enable_prefix_caching",
                "scheduling_policy", "enforce_eager", "attention_backend",
                "speculative_config", "tensor_parallel_size", "pipeline_parallel_size",
                "pipeline_layer_partition", "distributed_executor_backend",
                "runner", "convert", "pooler_config", "enable_lora", "max_loras",
                "max_lora_rank", "max_cpu_loras", "kv_offload_dir", "kv_offload_gib",
                "preemption_mode")


def given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The flags among `names` that were given (argparse leaves the others None)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def sampling_options(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: `defaults` overridden by the flags given."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def sampling_params(options: dict[str, Any]) -> "SamplingParams":
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(**options)


def make_llm(args: argparse.Namespace) -> "LLM":
    from llmserve.llm import LLM

    return LLM(args.model, **given(args, ENGINE_FLAGS))


def set_threads(args: argparse.Namespace) -> None:
    threads = getattr(args, "num_threads", None)  # the engine flag --threads
    if threads is None:
        return
    if threads < 1:
        raise ValueError("--threads must be at least 1")
    import torch

    torch.set_num_threads(threads)


# ---- flag groups --------------------------------------------------------------------------


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"catalog name, .gguf file or Hugging Face folder "
                        f"(default {DEFAULT_MODEL})")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, help="0 is greedy")
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--min-p", type=float)
    group.add_argument("--seed", type=int, help="per-request sampling seed")
    group.add_argument("--max-tokens", type=int, help="tokens to generate at most")
    group.add_argument("--stop", action="append", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", default=None,
                       help="keep generating past end-of-sequence tokens")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--mmproj", metavar="FILE",
                       help="a vision projector file for a GGUF model (as llama.cpp's "
                            "--mmproj): the model then takes images")
    group.add_argument("--dtype", help="auto, float32, float16 or bfloat16")
    group.add_argument("--device", help="auto, cpu or cuda[:N]")
    group.add_argument("--quantization", choices=QUANTIZATION_CHOICES,
                       help="auto (default with --dtype auto): a quantized checkpoint keeps "
                            "its quantization (GGUF Q4_*: int4, other GGUF: int8); none: "
                            "float weights; int8: W8A8 linear layers; int4: 4-bit weight "
                            "groups of 32, two-part int8 activations (15 bits); int4-a8: "
                            "the same with 8-bit activations (faster without an int8 dot "
                            "product instruction; auto picks it by timing)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES,
                       help="KV-cache entries: auto (int8 on the int8 weight path, bfloat16 on "
                            "the int4 path, else the "
                            "compute dtype), float32, bfloat16, int8 (per-token scales)")
    group.add_argument("--threads", dest="num_threads", type=int,
                       help="compute threads (default: all cores)")
    group.add_argument("--kv-cache-memory", type=kv_cache_memory,
                       help="KV-cache budget: a size (2GiB) or a fraction of free memory (0.3)")
    group.add_argument("--max-num-seqs", type=int)
    group.add_argument("--max-num-batched-tokens", type=int,
                       help="tokens per step, prompt chunks included (default 512)")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--block-size", type=int)
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=None)
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                       help="fcfs (default) and priority batch continuously; static admits "
                            "a batch and runs it to completion before the next")
    group.add_argument("--tensor-parallel-size", "-tp", type=int,
                       help="split the model over N processes (heads, MLP channels, "
                            "vocabulary; default 1)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int,
                       help="split the model's layers into N stages, each a process (or "
                            "-tp processes), activations sent stage to stage; under load "
                            "every stage is busy with its own batch (default 1)")
    group.add_argument("--pipeline-layer-partition", type=int_list, metavar="N,N,...",
                       help="each stage's number of layers, stage 0 first (e.g. 12,18 for "
                            "hosts of different speeds; default: split by their measured "
                            "cost)")
    group.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                       help="mp (default): this process starts the other ranks on this "
                            "machine; external_launcher: torchrun started every rank "
                            "(several machines, see docs/scaling.md)")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES,
                       help="auto (default): native kernels on the CPU, flex_attention on "
                            "CUDA; native, flex, or torch (SDPA over gathered blocks)")
    group.add_argument("--speculative-config", type=speculative_config,
                       help="speculative decoding, as JSON: method ngram (prompt lookup), "
                            "draft_model (with \"model\"), or self_draft (the checkpoint's "
                            "quantized self drafts for the exact path); "
                            "num_speculative_tokens, prompt_lookup_min/max, "
                            "disable_by_batch_size, adaptive")
    group.add_argument("--runner", choices=RUNNERS,
                       help="generate (default), or pooling: embeddings, classification and "
                            "scores (/v1/embeddings, /classify, /v1/score, /rerank); no "
                            "generation")
    group.add_argument("--convert", choices=CONVERTS,
                       help="the pooling runner's output: embed (default; the pooled hidden "
                            "state) or classify (the checkpoint's score head, or "
                            "classifier_from_token)")
    group.add_argument("--pooler-config", type=json_object,
                       help="the pooling runner's pooler, as JSON: pooling_type LAST "
                            "(default), MEAN or CLS; normalize (default true); "
                            "classifier_from_token (e.g. [\"no\", \"yes\"])")
    group.add_argument("--enable-lora", action="store_true", default=None,
                       help="serve LoRA adapters (PEFT) on the base model, many at once")
    group.add_argument("--max-loras", type=int, metavar="N",
                       help="adapters one step may run at once (default 1)")
    group.add_argument("--max-lora-rank", type=int, metavar="R",
                       help="the largest adapter rank accepted (default 16)")
    group.add_argument("--max-cpu-loras", type=int, metavar="N",
                       help="adapters kept loaded (default 16)")
    group.add_argument("--kv-offload-dir", metavar="PATH",
                       help="keep full KV blocks on local disk under PATH, the prefix cache's "
                            "second tier: a prompt whose prefix memory evicted (or a restart "
                            "lost) reads it back instead of recomputing it")
    group.add_argument("--kv-offload-gib", type=float, metavar="GIB",
                       help="the KV tier's size cap (default 8 with --kv-offload-dir); alone, "
                            "a tier in host memory (page-locked on CUDA)")
    group.add_argument("--preemption-mode", choices=PREEMPTION_MODES,
                       help="how a preempted request's KV comes back: auto (default: read from "
                            "the KV tier or recompute, whichever measures cheaper), recompute, "
                            "or swap (always read what the tier holds)")
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="never torch.compile the model step (float32 steps off the "
                            "native stack compile by default: a slower start, cached after)")


def add_network_flags(group: Any) -> None:
    """How `serve` and `router` listen and guard their routes."""
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                       "127.0.0.1; 0.0.0.0 to listen on every interface)")
    group.add_argument("--port", type=int, default=8000,
                       help="port (default 8000; 0: any free)")
    group.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route "
                       "but /health, /metrics and the chat page (default: $LLMSERVE_API_KEY)")
    group.add_argument("--metrics-require-auth", action="store_true",
                       help="protect /metrics with the API key too")
    group.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                       help="CORS origins, comma-separated or repeated (default: CORS off)")
    group.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                       help="largest request body; larger ones get 413 (default 4 MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGTERM (default 30)")
    group.add_argument("--header-timeout", type=positive_seconds,
                       default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection whose request headers are not complete this "
                       f"long after their first byte (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    group.add_argument("--body-timeout", type=positive_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                       metavar="SECONDS", help="answer 408 to a request whose body has not "
                       f"all arrived this long after its headers (default "
                       f"{DEFAULT_BODY_TIMEOUT_S:g})")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       metavar="N", help="open connections or requests in flight at most; "
                       f"beyond it answer 503 (default {DEFAULT_MAX_CONNECTIONS})")
    group.add_argument("--allowed-hosts", action="append", metavar="HOSTS",
                       help="answer only requests whose Host header names one of these "
                       "(comma-separated or repeated; *.example.com for subdomains): guards "
                       "a keyless local server against DNS rebinding (default: any)")


def add_route_prefix_flag(group: Any) -> None:
    group.add_argument("--route-prefix-chars", type=int, default=256, metavar="K",
                       help="prompt characters (or token ids) whose hash picks the replica "
                            "(default 256)")


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", dest="num_threads", type=int,
                        help="compute threads (default: all cores)")


# ---- argument types ----------------------------------------------------------------------


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def kv_cache_memory(text: str) -> str | float:
    """`--kv-cache-memory`: a fraction of free memory ("0.3") or a size ("2GiB", bytes)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if "." in text and value <= 1 else text


def speculative_config(text: str) -> dict:
    """`--speculative-config`: a JSON object in vLLM's keys, checked when the engine starts."""
    return json_object(text, 'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def json_object(text: str, example: str = "") -> dict:
    """A flag's JSON object value, checked by the config it goes to."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, not {text!r}"
                                         + (f" ({example})" if example else ""))
    return value


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None


def int_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH like 16:512, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parsed(parse: Any) -> Any:
    """An argparse type from a parser that raises ValueError with the message to show."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.strip().replace("-", "_"), value
