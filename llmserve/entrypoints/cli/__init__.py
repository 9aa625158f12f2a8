"""The `llmserve` command line: pull, models, generate, run-batch, chat, memory, serve, router,
bench.

Every subcommand is one small `cmd_*` function; each imports what it needs (torch, the
engine) itself, so that `--help` and usage errors stay quick. User errors (`LLMServeError`,
`ValueError`) print one `error: ...` line on stderr and exit 1; usage errors exit 2
(argparse); Ctrl-C exits 130.
"""

import argparse
import json
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmserve.config.engine import (
    ATTENTION_BACKEND_CHOICES,
    DEFAULT_MAX_NUM_WAITING,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
)
from llmserve.errors import LLMServeError
from llmserve.loader.catalog import DEFAULT_MODEL

if TYPE_CHECKING:
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                  "ignore_eos")
ENGINE_FLAGS = ("dtype", "device", "quantization", "kv_cache_dtype", "num_threads",
                "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "block_size", "enable_prefix_caching",
                "scheduling_policy", "enforce_eager", "attention_backend",
                "speculative_config", "tensor_parallel_size", "distributed_executor_backend")
GENERATE_DEFAULTS = {"max_tokens": 256}
# As llama.cpp's interactive defaults; a reply ends at the end of the turn well before this.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 2048}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and, as a script, exits with) the process exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve` relaunches replicas
    if hasattr(args, "check"):
        args.check(args)  # cross-flag usage rules: parser.error, exit 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if _is_torchrun_worker(args):  # ranks > 0 of an engine torchrun started
            from llmserve.executor.worker import run_external_worker

            run_external_worker(args.device or "cpu")
            return 0
        return args.func(args) or 0
    except (LLMServeError, ValueError) as e:
        message = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout piped into `head` and closed: not an error
        sys.stderr.close()
        return 0


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    return (getattr(args, "distributed_executor_backend", None) == "external_launcher"
            and os.environ.get("RANK", "0") != "0")


# ---- subcommands ---------------------------------------------------------------------------


def cmd_pull(args: argparse.Namespace) -> int:
    if args.list:
        return cmd_models(args)
    from llmserve.loader.catalog import catalog_entry, fetch_model

    entry = catalog_entry(args.model)
    licence = entry.license + (f" ({entry.license_url})" if entry.license_url else "")
    print(f"{entry.name}: {entry.description}\nlicence: {licence}; by using the model you "
          "accept its terms", file=sys.stderr)
    print(fetch_model(args.model, progress=True))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from llmserve.loader.catalog import list_catalog

    rows = [("NAME", "CACHED", "SIZE", "LICENCE", "DESCRIPTION")]
    for row in list_catalog():
        size = format_bytes(row.size) if row.size is not None else "-"
        rows.append((row.name, "yes" if row.cached else "no", size, row.license,
                     row.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[4]]))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.entrypoints import cli_generate

    base = sampling_options(args, GENERATE_DEFAULTS)
    if args.prompt is not None:
        params = _sampling_params(base)
        cli_generate.generate_one(_make_llm(args), args.prompt, params, args.chat)
        return 0
    items = cli_generate.read_batch(Path(args.input), base)  # all lines checked before loading
    if args.output == "-":
        cli_generate.generate_batch(_make_llm(args), items, sys.stdout, args.chat)
        return 0
    out_path = Path(args.output)
    if not out_path.parent.is_dir():
        raise LLMServeError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    llm = _make_llm(args)
    try:
        with out_path.open("w", encoding="utf-8") as out:
            cli_generate.generate_batch(llm, items, out, args.chat)
    except OSError as e:
        raise LLMServeError(f"cannot write {out_path}: {e.strerror or e}") from None
    print(f"wrote {len(items)} results to {out_path}", file=sys.stderr)
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    from llmserve.config.engine import EngineConfig
    from llmserve.engine.async_engine import AsyncEngine
    from llmserve.engine.engine import Engine
    from llmserve.entrypoints.cli_run_batch import read_batch_lines, run_batch_file
    from llmserve.entrypoints.openai.server import served_model_id

    lines = read_batch_lines(Path(args.input))  # read before the model loads
    if not lines:
        raise LLMServeError(f"{args.input} holds no requests")
    out: Path | Any = sys.stdout if args.output == "-" else Path(args.output)
    if isinstance(out, Path) and not out.parent.is_dir():
        raise LLMServeError(f"cannot write {out}: folder {out.parent} does not exist")
    options = {name: getattr(args, name) for name in ENGINE_FLAGS}
    config = EngineConfig(model=args.model, **{k: v for k, v in options.items() if v is not None})
    model_name = args.served_model_name or served_model_id(args.model)
    summary = run_batch_file(lambda: AsyncEngine(Engine(config)), model_name, lines, out,
                             args.max_concurrency, use_tqdm=not args.no_progress)
    where = "stdout" if out is sys.stdout else out
    print(f"run-batch: {summary.line()}; results in {where}", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli_generate import chat_repl

    params = _sampling_params(sampling_options(args, CHAT_DEFAULTS))
    chat_repl(_make_llm(args), params, args.system)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli_memory import memory_report

    print(memory_report(args.model, args.batch, args.seq_len, args.dtype, args.kv_dtype,
                        args.kv_cache_memory, args.block_size, args.device,
                        args.quantization, args.tensor_parallel_size))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        from llmserve.router.launcher import run_data_parallel

        return run_data_parallel(args, args.argv)
    from llmserve.entrypoints.openai.server import run_server

    options = {name: getattr(args, name) for name in (*ENGINE_FLAGS, "kv_role",
                                                      "kv_transfer_address")}
    return run_server(args, {k: v for k, v in options.items() if v is not None})


def cmd_router(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.openai.server import listening_socket
    from llmserve.router.app import (
        build_disaggregated_app,
        build_router_app,
        router_settings,
        run_router,
    )
    from llmserve.router.replicas import Replica

    settings = router_settings(args)  # checked before the port is taken
    if args.prefill:
        app = build_disaggregated_app(args.prefill[0], args.decode[0], settings)
        banner = f"routing to prefill {args.prefill[0]} and decode {args.decode[0]}"
    else:
        app = build_router_app([Replica(i, url) for i, url in enumerate(args.replica)],
                               settings)
        banner = f"routing to {len(args.replica)} replicas"
    sock = listening_socket(args.host, args.port)
    run_router(app, settings, sock, banner, access_log=args.verbose)
    return 0


# ---- shared helpers ------------------------------------------------------------------------


def sampling_options(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: `defaults` overridden by the flags given."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def _sampling_params(options: dict[str, Any]) -> "SamplingParams":
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(**options)


def _make_llm(args: argparse.Namespace) -> "LLM":
    from llmserve.llm import LLM

    options = {name: getattr(args, name) for name in ENGINE_FLAGS}
    options = {k: v for k, v in options.items() if v is not None}
    return LLM(args.model, **options)


def kv_cache_memory(text: str) -> str | float:
    """`--kv-cache-memory`: a fraction of free memory ("0.3") or a size ("2GiB", bytes)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if "." in text and value <= 1 else text


def speculative_config(text: str) -> dict:
    """`--speculative-config`: a JSON object in vLLM's keys, checked when the engine starts."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            'a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    return value


def format_bytes(num: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:,.0f} {unit}" if unit == "bytes" else f"{num:,.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


# ---- argument parser -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show INFO logs")
    parser.set_defaults(verbose=False)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show INFO logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_pull(sub, common)
    _add_generate(sub, common)
    _add_run_batch(sub, common)
    _add_chat(sub, common)
    _add_memory(sub, common)
    _add_serve(sub, common)
    _add_router(sub, common)
    _add_bench(sub, common)
    return parser


def _add_pull(sub: Any, common: argparse.ArgumentParser) -> None:
    pull = sub.add_parser("pull", parents=[common], help="fetch a catalog model into the cache")
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="catalog name")
    pull.add_argument("--list", action="store_true", help="list the catalog instead")
    pull.set_defaults(func=cmd_pull)
    models = sub.add_parser("models", parents=[common], help="list the catalog models")
    models.set_defaults(func=cmd_models)


def _add_generate(sub: Any, common: argparse.ArgumentParser) -> None:
    gen = sub.add_parser(
        "generate", parents=[common], help="complete one prompt or a JSONL file of prompts",
        description="Stream one completion (--prompt) or run a JSONL file of prompts as one "
        "continuous batch (--input/--output); input lines: {\"prompt\"|\"messages\"|"
        "\"prompt_token_ids\": ..., \"id\"?, sampling overrides?}.",
    )
    _add_model_flag(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to complete; streamed to stdout")
    source.add_argument("--input", metavar="IN.jsonl", help="JSONL file of prompts")
    gen.add_argument("--output", metavar="OUT.jsonl", help="where --input results go ('-': stdout)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap text prompts as a user turn in the model's chat template")
    _add_sampling_flags(gen)
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate, check=partial(_check_generate_args, gen))


def _check_generate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.input is not None and args.output is None:
        parser.error("--input needs --output")
    if args.prompt is not None and args.output is not None:
        parser.error("--output goes with --input; --prompt streams to stdout")


def _add_run_batch(sub: Any, common: argparse.ArgumentParser) -> None:
    batch = sub.add_parser(
        "run-batch", parents=[common], help="run an OpenAI Batch file offline",
        description="Run an OpenAI Batch input file (lines {\"custom_id\", \"method\": "
        "\"POST\", \"url\": \"/v1/chat/completions\" or \"/v1/completions\", \"body\"}) "
        "through the server's handlers as one continuous batch; the output has one line per "
        "input line, in order, in OpenAI's batch output format. An existing output file is "
        "resumed: lines with a result there are not run again.")
    _add_model_flag(batch)
    batch.add_argument("-i", "--input", required=True, metavar="IN.jsonl",
                       help="OpenAI Batch input file")
    batch.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                       help="results ('-': stdout, in order as they are ready)")
    batch.add_argument("--served-model-name",
                       help="the model id bodies may name (default: --model)")
    batch.add_argument("--max-concurrency", type=int, default=64, metavar="N",
                       help="requests in flight at most (default 64)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_engine_flags(batch)
    batch.set_defaults(func=cmd_run_batch, check=partial(_check_run_batch_args, batch))


def _check_run_batch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")


def _add_chat(sub: Any, common: argparse.ArgumentParser) -> None:
    chat = sub.add_parser("chat", parents=[common], help="interactive chat in the terminal")
    _add_model_flag(chat)
    chat.add_argument("--system", help="system prompt")
    _add_sampling_flags(chat)
    _add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)


def _add_memory(sub: Any, common: argparse.ArgumentParser) -> None:
    mem = sub.add_parser("memory", parents=[common],
                         help="weights and KV-cache memory of a model, and what fits")
    _add_model_flag(mem)
    mem.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    mem.add_argument("--seq-len", type=int, help="tokens per sequence (default: model context)")
    mem.add_argument("--dtype", default="auto", help="weight dtype (default auto)")
    mem.add_argument("--kv-dtype", help="KV-cache dtype (default: as the engine picks it)")
    mem.add_argument("--quantization", choices=QUANTIZATION_CHOICES,
                     help="as for serve (default: auto)")
    mem.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    mem.add_argument("--kv-cache-memory", type=kv_cache_memory, default="2GiB",
                     help="KV-cache budget: a size (2GiB) or a fraction of free memory (0.3)")
    mem.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    mem.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="also show each rank's share (default 1)")
    mem.set_defaults(func=cmd_memory)


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser("serve", parents=[common], help="run the OpenAI-compatible server")
    _add_model_flag(serve)
    net = serve.add_argument_group("server")
    _add_network_flags(net)
    net.add_argument("--served-model-name", help="model id clients use (default: --model)")
    net.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                     help="queued requests at most; beyond it answer 429 (default: "
                          f"{DEFAULT_MAX_NUM_WAITING}; -1: no cap)")
    net.add_argument("--request-timeout", type=float, metavar="SECONDS",
                     help="end a request that runs longer than this from its arrival, with "
                          "an error (its KV blocks are freed at once; default: no limit)")
    _add_engine_flags(serve)
    dp = serve.add_argument_group("data parallelism")
    dp.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                    help="N engine processes behind one endpoint, requests routed by prompt "
                         "prefix and load; --threads is then per replica (default: cores / N)")
    _add_route_prefix_flag(dp)
    pd = serve.add_argument_group("disaggregated prefill/decode (see docs/scaling.md)")
    pd.add_argument("--role", dest="kv_role", choices=("prefill", "decode"),
                    help="prefill: send each finished prompt's KV blocks to the decode server; "
                         "decode: continue requests from the KV blocks received (put "
                         "'llmserve router --prefill URL --decode URL' in front)")
    pd.add_argument("--kv-transfer-address", metavar="HOST:PORT",
                    help="where the prefill and decode servers meet (the decode server "
                         "listens there)")
    serve.set_defaults(func=cmd_serve, check=partial(_check_serve_args, serve))


def _check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if (args.kv_role is None) != (args.kv_transfer_address is None):
        parser.error("--role and --kv-transfer-address go together")
    if args.kv_role is not None and args.data_parallel_size > 1:
        parser.error("--role does not combine with --data-parallel-size")


def _add_router(sub: Any, common: argparse.ArgumentParser) -> None:
    router = sub.add_parser(
        "router", parents=[common], help="one endpoint in front of running llmserve servers",
        description="Route OpenAI requests to llmserve servers already running (prompts that "
        "start alike go to the same server, whose prefix cache holds them; load spills "
        "over), or split each generation request between a prefill server and a decode "
        "server (--prefill, --decode); /health is 200 while every server is, /metrics "
        "labels each server's.")
    router.add_argument("--replica", action="append", metavar="URL",
                        help="a server's base URL, e.g. http://127.0.0.1:8001 (repeat)")
    router.add_argument("--prefill", action="append", metavar="URL",
                        help="disaggregated prefill/decode: the prefill server's base URL "
                        "(with --decode)")
    router.add_argument("--decode", action="append", metavar="URL",
                        help="disaggregated prefill/decode: the decode server's base URL "
                        "(with --prefill)")
    net = router.add_argument_group("server")
    _add_network_flags(net)
    _add_route_prefix_flag(net)
    router.set_defaults(func=cmd_router, check=partial(_check_router_args, router))


def _check_router_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    split = args.prefill or args.decode
    if args.replica and split:
        parser.error("--replica cannot be combined with --prefill/--decode: give --replica "
                     "URL (repeated) for data-parallel replicas, or --prefill URL --decode "
                     "URL for disaggregated prefill/decode")
    if not args.replica and not split:
        parser.error("give the servers to route to: --replica URL (repeated), or "
                     "--prefill URL --decode URL")
    if split and not (args.prefill and args.decode):
        parser.error("--prefill and --decode go together: give one URL for each")
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        if urls and len(urls) > 1:
            parser.error(f"{flag} was given {len(urls)} times: the router takes exactly one "
                         f"prefill server and one decode server")


def _add_network_flags(group: Any) -> None:
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


def _add_route_prefix_flag(group: Any) -> None:
    group.add_argument("--route-prefix-chars", type=int, default=256, metavar="K",
                       help="prompt characters (or token ids) whose hash picks the replica "
                            "(default 256)")


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    from llmserve.entrypoints.cli_bench import add_bench  # imports this module's helpers

    add_bench(sub, common)


def _add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"catalog name, .gguf file or Hugging Face folder "
                        f"(default {DEFAULT_MODEL})")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
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
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="never torch.compile the model step (float32 steps off the "
                            "native stack compile by default: a slower start, cached after)")


if __name__ == "__main__":
    sys.exit(main())
