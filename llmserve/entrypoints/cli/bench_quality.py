"""`llmserve bench quality` and `spec`: how far a faster path's output is from the exact
path's, and what speculative decoding buys."""

import argparse
from typing import Any

from llmserve.entrypoints.cli.args import (
    add_model_flag,
    add_threads_flag,
    engine_arg,
    int_list,
    kv_cache_memory,
    set_threads,
    str_list,
)
from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.cli.output import write_json

# `bench quality`'s engines hold one window's KV cache, not the serving default
QUALITY_KV_CACHE_MEMORY = "256MiB"


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from llmserve.bench.quality import (
        QUALITY_TEXT,
        format_peer_table,
        format_table,
        llama_cpp_perplexity,
        plan_windows,
        quality_text,
        read_text_file,
        report,
        run_quality,
    )

    stride = args.window if args.stride is None else args.stride
    plan_windows(1, args.window, stride, has_bos=False)  # bad sizes fail before any loading
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    set_threads(args)
    common = {k: v for k, v in (("device", args.device),
                                ("kv_cache_memory", args.kv_cache_memory)) if v is not None}
    text = read_text_file(args.text) if args.text else None
    source = args.text or f"llmserve/bench/{QUALITY_TEXT}"
    candidates = quality_candidates(args.quantization, candidate_options(args))
    peer_model = _peer_model(args) if args.llama_perplexity else None
    scored, results = run_quality(args.model, candidates, common, text, args.window, stride,
                                  args.max_tokens, half_windows=peer_model is not None)
    print(format_table(scored, results, args.window, stride, source))
    peer = None
    if peer_model is not None:
        peer = llama_cpp_perplexity(args.llama_perplexity, peer_model,
                                    quality_text() if text is None else text, args.window,
                                    args.num_threads)
        print(format_peer_table(scored, results, peer, args.window))
    if args.output_json:
        write_json(args.output_json, report(args.model, scored, results, args.window, stride,
                                            source, common, peer))
    return 0


def _peer_model(args: argparse.Namespace) -> str:
    """The GGUF file llama.cpp's llama-perplexity runs (the one --model names)."""
    from llmserve.loader.catalog import resolve_model

    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise ValueError("--llama-perplexity runs a GGUF file: give --model one")
    if args.max_tokens is not None:
        raise ValueError("--llama-perplexity scores the whole text: leave out --max-tokens")
    return str(source.path)


def candidate_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine options every non-default candidate gets: --dtype, --kv-cache-dtype and each
    --engine-arg, passed to `LLM` as they are (the engine judges them)."""
    options: dict[str, Any] = {}
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.kv_cache_dtype is not None:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    options.update(args.engine_arg or [])
    return options


def quality_candidates(quantizations: list[str] | None,
                       options: dict[str, Any]) -> list[dict[str, Any]]:
    """The default configuration first, then one candidate per --quantization, each with
    `options`; a configuration appears once. Names go to the engine as they are."""
    candidates: list[dict[str, Any]] = [{}]
    for name in quantizations or [None]:
        candidate = {**options, **({} if name is None else {"quantization": name})}
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from llmserve.bench.machine import format_machine
    from llmserve.bench.spec import HEADER, format_report, run_spec_bench

    heads = {m: folder for m, folder in (("medusa", args.medusa), ("eagle", args.eagle),
                                         ("eagle3", args.eagle3))
             if folder is not None}
    methods = [*args.methods, *[m for m in heads if m not in args.methods]]
    unknown = [m for m in methods if m not in ("ngram", "self_draft", "eagle", *heads)]
    if unknown:
        raise ValueError(f"--methods: {unknown[0]!r} is not ngram, self_draft or eagle "
                         "(medusa and eagle3 come with --medusa / --eagle3 FOLDER; eagle "
                         "without --eagle drafts with the head that ships for the model)")
    unknown = [p for p in args.paths if p not in ("default", "float32")]
    if unknown:
        raise ValueError(f"--paths: {unknown[0]!r} is not default or float32")
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    set_threads(args)
    print(format_machine(), flush=True)
    print(HEADER, flush=True)
    data = run_spec_bench(args.model, methods, args.paths, args.max_tokens,
                          [c for c in args.concurrency if c > 0], args.num_speculative_tokens,
                          log=lambda line: print(line, flush=True),
                          crossover_method=args.crossover_method,
                          crossover_path=args.crossover_path, heads=heads,
                          repeats=args.repeats)
    print("\n".join(format_report(data).splitlines()[-2:]))
    if args.output_json:
        write_json(args.output_json, data)
    return 0


def _quality_arguments(qa: argparse.ArgumentParser) -> None:
    add_model_flag(qa)
    qa.add_argument("--quantization", nargs="+", metavar="Q",
                    help="candidate quantization methods, one candidate each")
    qa.add_argument("--kv-cache-dtype", help="KV-cache dtype of the candidates")
    qa.add_argument("--dtype", help="compute dtype of the candidates (default auto)")
    qa.add_argument("--engine-arg", action="append", type=engine_arg, metavar="KEY=VALUE",
                    help="any other LLM(...) option for the candidates (repeatable; VALUE "
                    "is read as JSON when it parses, else as a string)")
    qa.add_argument("--device", help="auto, cpu or cuda[:N] (reference and candidates)")
    qa.add_argument("--kv-cache-memory", type=kv_cache_memory, default=QUALITY_KV_CACHE_MEMORY,
                    help=f"KV-cache budget of each engine (default {QUALITY_KV_CACHE_MEMORY})")
    qa.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    qa.add_argument("--stride", type=int,
                    help="tokens between window starts (default --window: no overlap)")
    qa.add_argument("--max-tokens", type=int, help="score only the text's first N tokens")
    qa.add_argument("--text", metavar="FILE", help="another UTF-8 text to score instead")
    qa.add_argument("--llama-perplexity", metavar="BIN",
                    help="llama.cpp's llama-perplexity binary: run it on the same GGUF file "
                    "and text, and score every path as it scores, side by side")
    qa.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    add_threads_flag(qa)


def _spec_arguments(sp: argparse.ArgumentParser) -> None:
    add_model_flag(sp)
    sp.add_argument("--methods", type=str_list, default=["ngram", "self_draft"],
                    help="methods to compare with none (default ngram,self_draft)")
    sp.add_argument("--paths", type=str_list, default=["default", "float32"],
                    help="default (quantized) and/or float32 (exact); default both")
    sp.add_argument("--medusa", metavar="FOLDER",
                    help="Medusa heads (`llmserve train-heads`): compare method medusa too")
    sp.add_argument("--eagle", metavar="FOLDER",
                    help="an EAGLE head (`llmserve train-heads --method eagle`): compare "
                         "method eagle too (`--methods ...,eagle` without it: the head "
                         "that ships for the model)")
    sp.add_argument("--eagle3", metavar="FOLDER",
                    help="an EAGLE-3 head (the published layout): compare method eagle3 too")
    sp.add_argument("--num-speculative-tokens", type=int, default=4,
                    help="most drafts per step (default 4)")
    sp.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    sp.add_argument("--repeats", type=int, default=1,
                    help="batch-1 runs per workload, the methods taking turns; the speedup "
                         "is the median of the run-by-run ratios (default 1)")
    sp.add_argument("--concurrency", type=int_list, default=(1, 2, 4, 8, 16, 32),
                    help="concurrencies for the crossover (default 1,2,4,8,16,32; 0: skip)")
    sp.add_argument("--crossover-method", choices=("ngram", "self_draft"), default="ngram",
                    help="the method of the concurrency sweep (default ngram)")
    sp.add_argument("--crossover-path", choices=("default", "float32"), default="default",
                    help="the path of the concurrency sweep (default: default)")
    sp.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    add_threads_flag(sp)


QUALITY = Command(
    "quality",
    help="perplexity, KL and top-1 agreement of a path against the exact float32 path",
    description="Run a fixed English text through the exact float32 path and through "
    "each candidate: the default configuration, then one per --quantization (with "
    "--dtype, --kv-cache-dtype and --engine-arg applied to it).",
    add_arguments=_quality_arguments, run=cmd_bench_quality)
SPEC = Command(
    "spec", help="speculative decoding: batch-1 tok/s, acceptance and speedup per method and "
    "path on grounded and chat workloads, and the concurrency where it stops paying",
    add_arguments=_spec_arguments, run=cmd_bench_spec)
