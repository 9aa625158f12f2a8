"""`llmserve serve`: the OpenAI-compatible server, one engine or data-parallel replicas
behind a router, optionally one side of disaggregated prefill/decode."""

import argparse

from llmserve.config.engine import (
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MAX_LOADED_MODELS,
    DEFAULT_MAX_NUM_WAITING,
)
from llmserve.entrypoints.cli.args import (
    ENGINE_FLAGS,
    add_engine_flags,
    add_model_flag,
    add_network_flags,
    add_route_prefix_flag,
    given,
)
from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.openai.reasoning import CHOICES
from llmserve.router.ray_serve import DEFAULT_TARGET_ONGOING_REQUESTS


def cmd_serve(args: argparse.Namespace) -> int:
    if args.models_dir is not None:
        from llmserve.router.models_app import run_models_server

        return run_models_server(args, args.argv)
    if args.data_parallel_backend == "ray":
        from llmserve.entrypoints.openai.server import served_model_id
        from llmserve.loader.catalog import DEFAULT_MODEL
        from llmserve.router.ray_serve import run_ray_serve

        return run_ray_serve(args, args.argv, args.served_model_name
                             or served_model_id(args.model or DEFAULT_MODEL))
    if args.data_parallel_size > 1:
        from llmserve.router.launcher import run_data_parallel

        return run_data_parallel(args, args.argv)
    from llmserve.entrypoints.openai.server import run_server

    return run_server(args, given(args, (*ENGINE_FLAGS, "kv_role", "kv_transfer_address")))


def _arguments(serve: argparse.ArgumentParser) -> None:
    add_model_flag(serve)
    net = serve.add_argument_group("server")
    add_network_flags(net)
    net.add_argument("--served-model-name", help="model id clients use (default: --model)")
    net.add_argument("--reasoning-parser", choices=CHOICES, default="auto",
                     help="split the model's <think>...</think> into reasoning_content "
                          "(chat); a response_format or tool grammar then applies after it. "
                          "auto (default): the family the chat template declares (qwen3 "
                          "when it has enable_thinking, else deepseek_r1), none without "
                          "<think>; none: never")
    net.add_argument("--allowed-media-domains", action="append", metavar="HOSTS",
                     help="hosts (and their subdomains) whose http(s) image URLs the server "
                          "fetches, comma-separated or repeated (default: none; images come "
                          "as data URLs)")
    net.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                     help="LoRA adapters to serve from the start (with --enable-lora); a "
                          "request's model names one")
    net.add_argument("--allow-runtime-lora", action="store_true",
                     help="let clients load and unload adapters while the server runs "
                          "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter), from under "
                          "--lora-dir only (with --enable-lora)")
    net.add_argument("--lora-dir", metavar="DIR",
                     help="the folder runtime loads read from: a lora_path is taken relative "
                          "to it, and nothing that resolves outside it (.., a symlink out) is "
                          "read (with --allow-runtime-lora)")
    net.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                     help="queued requests at most; beyond it answer 429 (default: "
                          f"{DEFAULT_MAX_NUM_WAITING}; -1: no cap)")
    net.add_argument("--request-timeout", type=float, metavar="SECONDS",
                     help="end a request that runs longer than this from its arrival, with "
                          "an error (its KV blocks are freed at once; default: no limit)")
    net.add_argument("--grammar-timeout", type=float, metavar="SECONDS",
                     default=DEFAULT_GRAMMAR_TIMEOUT_S,
                     help="refuse (400) a structured-output constraint that takes longer than "
                          "this to compile (compiled off the engine thread, at the lowest "
                          f"CPU priority; default: {DEFAULT_GRAMMAR_TIMEOUT_S:g})")
    add_engine_flags(serve)
    dp = serve.add_argument_group("data parallelism")
    dp.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                    help="N engine processes behind one endpoint, requests routed by prompt "
                         "prefix and load; --threads is then per replica (default: cores / N)")
    dp.add_argument("--data-parallel-backend", choices=("local", "ray"), default="local",
                    help="local (default): the replicas are processes on this machine behind "
                         "llmserve's router; ray: a Ray Serve application on the Ray cluster "
                         "(RAY_ADDRESS), one deployment, replicas placed on its nodes")
    dp.add_argument("--max-data-parallel-size", type=int, metavar="M",
                    help="ray: autoscale between --data-parallel-size and M replicas on "
                         "requests in flight per replica")
    dp.add_argument("--target-ongoing-requests", type=int, metavar="K",
                    default=DEFAULT_TARGET_ONGOING_REQUESTS,
                    help="ray: the requests in flight per replica autoscaling aims at "
                         f"(default {DEFAULT_TARGET_ONGOING_REQUESTS})")
    add_route_prefix_flag(dp)
    many = serve.add_argument_group("many models behind one endpoint (see the README)")
    many.add_argument("--models-dir", metavar="DIR",
                      help="serve every .gguf file and Hugging Face folder directly under DIR "
                           "and the catalog's pulled models, each loaded in a process of its "
                           "own on the first request that names it (instead of --model)")
    many.add_argument("--max-loaded-models", type=int, default=DEFAULT_MAX_LOADED_MODELS,
                      metavar="N",
                      help="models loaded at most; loading one more unloads the least "
                           "recently used idle one (default: "
                           f"{DEFAULT_MAX_LOADED_MODELS})")
    many.add_argument("--max-loaded-memory", metavar="SIZE",
                      help="memory the loaded models' processes may hold together (e.g. "
                           "12GiB); loading one more unloads idle ones until it fits "
                           "(default: no budget)")
    many.add_argument("--keep-alive", default=DEFAULT_KEEP_ALIVE, metavar="DURATION",
                      help="unload a model idle this long (e.g. 30s, 10m, 1h; -1: never); an "
                           "Ollama request's keep_alive sets its model's (default: "
                           f"{DEFAULT_KEEP_ALIVE})")
    many.add_argument("--pin", action="append", metavar="NAME",
                      help="load this model at start and never unload it (repeatable)")
    pd = serve.add_argument_group("disaggregated prefill/decode (see docs/scaling.md)")
    pd.add_argument("--role", dest="kv_role", choices=("prefill", "decode"),
                    help="prefill: send each finished prompt's KV blocks to the decode server; "
                         "decode: continue requests from the KV blocks received (put "
                         "'llmserve router --prefill URL --decode URL' in front)")
    pd.add_argument("--kv-transfer-address", metavar="HOST:PORT",
                    help="where the prefill and decode servers meet (the decode server "
                         "listens there)")


def _check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if (args.kv_role is None) != (args.kv_transfer_address is None):
        parser.error("--role and --kv-transfer-address go together")
    if args.kv_role is not None and args.data_parallel_size > 1:
        parser.error("--role does not combine with --data-parallel-size")
    if args.data_parallel_backend != "ray" and (
            args.max_data_parallel_size is not None
            or args.target_ongoing_requests != DEFAULT_TARGET_ONGOING_REQUESTS):
        parser.error("--max-data-parallel-size and --target-ongoing-requests go with "
                     "--data-parallel-backend ray")
    if args.max_data_parallel_size is not None and \
            args.max_data_parallel_size < args.data_parallel_size:
        parser.error("--max-data-parallel-size must be at least --data-parallel-size")
    if args.target_ongoing_requests < 1:
        parser.error("--target-ongoing-requests must be at least 1")
    if args.data_parallel_backend == "ray" and (args.kv_role is not None
                                                or args.models_dir is not None):
        parser.error("--data-parallel-backend ray serves one model (no --role, no "
                     "--models-dir)")
    if args.models_dir is not None:
        _check_models_dir_args(parser, args)
    if args.grammar_timeout <= 0:
        parser.error(f"--grammar-timeout must be > 0 seconds, got {args.grammar_timeout}")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora and not args.enable_lora:
        parser.error("--allow-runtime-lora needs --enable-lora")
    if args.allow_runtime_lora != (args.lora_dir is not None):
        parser.error("--allow-runtime-lora and --lora-dir DIR go together")


def _check_models_dir_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that name one model, or split one across processes, have no place when
    requests name the model."""
    argv = args.argv
    for flag in ("--model", "--served-model-name", "--lora-modules", "--allow-runtime-lora",
                 "--data-parallel-size", "--role"):
        if any(a == flag or a.startswith(f"{flag}=") for a in argv):
            parser.error(f"{flag} does not combine with --models-dir (a request's model "
                         "names one of the folder's)")
    if args.max_loaded_models < 1:
        parser.error(f"--max-loaded-models must be at least 1, got {args.max_loaded_models}")
    from llmserve.entrypoints.openai.serving_ollama import keep_alive_seconds
    from llmserve.memory import parse_size

    try:
        keep_alive_seconds(args.keep_alive)
        if args.max_loaded_memory is not None:
            parse_size(args.max_loaded_memory)
    except ValueError as exc:
        parser.error(str(exc))


COMMAND = Command("serve", help="run the OpenAI-compatible server", add_arguments=_arguments,
                  run=cmd_serve, check=_check_serve_args)
