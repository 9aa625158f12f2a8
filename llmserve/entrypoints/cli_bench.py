"""`llmserve bench ...`: throughput, serve, latency, quality, spec, scaling, soak and plot,
as `cmd_*` functions and their argument parsers. Errors follow the CLI's rule: one
`error: ...` line, exit 1.
"""

import argparse
import json
from pathlib import Path
from typing import Any

from llmserve.entrypoints.cli import (
    _add_engine_flags,
    _add_model_flag,
    _make_llm,
    kv_cache_memory,
)
from llmserve.errors import LLMServeError

# `bench quality`'s engines hold one window's KV cache, not the serving default
QUALITY_KV_CACHE_MEMORY = "256MiB"


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from llmserve.bench.throughput import format_table, report, run_throughput

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.compare_static and args.scheduling_policy == "static":
        raise ValueError("--compare-static compares continuous batching with static: leave "
                         "--scheduling-policy at fcfs or priority")
    modes = ["batched", "sequential"] if args.compare else [
        "sequential" if args.sequential else "batched"]
    if args.compare_static:
        modes = ["batched", "static"]
    llm = _make_llm(args)
    results = [
        run_throughput(llm, args.num_prompts, args.input_len, args.output_len, mode,
                       seed=args.seed + i,  # a seed per run: no prefix-cache hits across runs
                       random_output_len=args.random_output_len, lengths_seed=args.seed)
        for i, mode in enumerate(modes)
    ]
    print(format_table(results, llm))
    if args.compare or args.compare_static:
        speedup = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        print(f"batched / {modes[1]} output throughput: {speedup:.2f}x")
    if args.output_json:
        write_json(args.output_json, report(llm, results, seed=args.seed))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        import httpx

        from llmserve.bench.serve import ServeBenchConfig, format_summary, run_serve_bench
    except ModuleNotFoundError as e:
        raise LLMServeError(f"bench serve needs {e.name}: pip install 'llmserve[bench]'") from None
    from llmserve.bench.stats import SLO

    config = ServeBenchConfig(
        base_url=args.base_url, model=args.model, concurrencies=args.concurrency,
        request_rate=args.request_rate, burstiness=args.burstiness,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        workload=args.workload, dataset=args.dataset, shared_prefix_len=args.shared_prefix_len,
        slo=SLO(args.slo_ttft, args.slo_tpot), api_key=args.api_key, endpoint=args.endpoint,
        tokenizer_model=args.tokenizer_model, label=args.label, seed=args.seed,
        structured=args.structured)
    try:
        data = run_serve_bench(config)
    except httpx.HTTPError as e:  # what the client did not already turn into a message
        raise LLMServeError(f"talking to {config.base_url}: {type(e).__name__}: {e}") from None
    print(format_summary(data))
    if args.output_json:
        write_json(args.output_json, data)
    if args.plot:
        if not args.output_json:
            raise LLMServeError("--plot draws from the result file: give --output-json too")
        from llmserve.bench.plot import plot_reports

        plot_reports([Path(args.output_json)], Path(args.plot))
    return 0


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from llmserve.bench.latency import (
        format_table,
        llm_peak_kind,
        measure_bandwidth,
        measure_peaks,
        report,
        run_latency,
    )

    for name in ("input_len", "output_len"):
        if getattr(args, name) < 2:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 2")
    if min(args.batch) < 1:
        raise ValueError("--batch takes positive integers, e.g. 1,8")
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    llm = _make_llm(args)
    run_latency(llm, max(args.batch), 16, 4, seed=99)  # warm-up
    device = llm.engine.device
    results = [run_latency(llm, b, args.input_len, args.output_len, seed=i,
                           repeats=args.repeat, bandwidth=lambda: measure_bandwidth(device))
               for i, b in enumerate(args.batch)]
    peaks = measure_peaks(device, llm_peak_kind(llm))
    print(format_table(results, peaks, llm))
    if args.output_json:
        write_json(args.output_json, report(llm, results, peaks))
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from llmserve.bench.kernels import format_kernels, run_kernels
    from llmserve.entrypoints.cli_memory import read_model_config
    from llmserve.loader.catalog import resolve_model

    if min(args.batch) < 1:
        raise ValueError("--batch takes positive integers, e.g. 1,32")
    result = run_kernels(read_model_config(resolve_model(args.model)), tuple(args.batch))
    print(format_kernels(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from llmserve.bench.quality import (
        QUALITY_TEXT,
        format_table,
        plan_windows,
        read_text_file,
        report,
        run_quality,
    )

    stride = args.window if args.stride is None else args.stride
    plan_windows(1, args.window, stride, has_bos=False)  # bad sizes fail before any loading
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    _set_threads(args)
    common = {k: v for k, v in (("device", args.device),
                                ("kv_cache_memory", args.kv_cache_memory)) if v is not None}
    text = read_text_file(args.text) if args.text else None
    source = args.text or f"llmserve/bench/{QUALITY_TEXT}"
    candidates = quality_candidates(args.quantization, candidate_options(args))
    scored, results = run_quality(args.model, candidates, common, text, args.window, stride,
                                  args.max_tokens)
    print(format_table(scored, results, args.window, stride, source))
    if args.output_json:
        write_json(args.output_json, report(args.model, scored, results, args.window, stride,
                                            source, common))
    return 0


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

    unknown = [m for m in args.methods if m not in ("ngram", "self_draft")]
    if unknown:
        raise ValueError(f"--methods: {unknown[0]!r} is not ngram or self_draft")
    unknown = [p for p in args.paths if p not in ("default", "float32")]
    if unknown:
        raise ValueError(f"--paths: {unknown[0]!r} is not default or float32")
    _set_threads(args)
    print(format_machine(), flush=True)
    print(HEADER, flush=True)
    data = run_spec_bench(args.model, args.methods, args.paths, args.max_tokens,
                          [c for c in args.concurrency if c > 0], args.num_speculative_tokens,
                          log=lambda line: print(line, flush=True),
                          crossover_method=args.crossover_method,
                          crossover_path=args.crossover_path)
    print("\n".join(format_report(data).splitlines()[-2:]))
    if args.output_json:
        write_json(args.output_json, data)
    return 0


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from llmserve.bench.machine import format_machine
    from llmserve.bench.scaling import run_scaling_bench

    if any(size < 1 for size in args.tensor_parallel_sizes):
        raise ValueError("--tensor-parallel-sizes must be at least 1")
    print(format_machine(), flush=True)
    data = run_scaling_bench(args.model, args.dtype, args.tensor_parallel_sizes, args.batch,
                             args.input_len, args.output_len,
                             [n for n in args.prompt_lens if n > 0],
                             log=lambda line: print(line, flush=True))
    if args.output_json:
        write_json(args.output_json, data)
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    import shlex

    from llmserve.bench.machine import format_machine
    from llmserve.bench.soak import SoakConfig, run_soak
    from llmserve.bench.soak_report import format_soak, plot_soak

    if args.plot and not args.output_json:
        raise LLMServeError("--plot draws from the result file: give --output-json too")
    config = SoakConfig(
        base_url=args.base_url, model=args.model, server_pid=args.server_pid,
        server_args=tuple(shlex.split(args.server_args or "")), duration_s=args.duration,
        concurrency=args.concurrency, sample_interval_s=args.sample_interval,
        warmup_s=args.warmup, disconnect_fraction=args.disconnect_fraction,
        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
        api_key=args.api_key)
    print(format_machine(), flush=True)
    report = run_soak(config)
    print(format_soak(report))
    if args.output_json:
        write_json(args.output_json, report)
    if args.plot:
        plot_soak(report, Path(args.plot))
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    import sys

    from llmserve.bench.plot import plot_reports

    plot_reports([Path(f) for f in args.results], Path(args.output))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def write_json(path: str, data: Any) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise LLMServeError(f"cannot write {path}: {e.strerror or e}") from None


def _set_threads(args: argparse.Namespace) -> None:
    threads = getattr(args, "num_threads", None)  # the engine flag --threads
    if threads is None:
        return
    if threads < 1:
        raise ValueError("--threads must be at least 1")
    import torch

    torch.set_num_threads(threads)


# ---- argument parsers ----------------------------------------------------------------------


def add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    _add_bench_throughput(kinds, common)
    _add_bench_serve(kinds, common)
    _add_bench_latency(kinds, common)
    _add_bench_kernels(kinds, common)
    _add_bench_quality(kinds, common)
    _add_bench_spec(kinds, common)
    _add_bench_scaling(kinds, common)
    _add_bench_soak(kinds, common)
    _add_bench_plot(kinds, common)


def _add_bench_throughput(kinds: Any, common: argparse.ArgumentParser) -> None:
    tp = kinds.add_parser("throughput", parents=[common],
                          help="offline throughput of synthetic prompts through LLM.generate")
    _add_model_flag(tp)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    tp.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    tp.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    mode = tp.add_mutually_exclusive_group()
    mode.add_argument("--sequential", action="store_true",
                      help="one request at a time through the same engine")
    mode.add_argument("--compare-static", action="store_true",
                      help="run continuous batching, then the same engine batch by batch "
                           "(static), and print the speed-up")
    mode.add_argument("--compare", action="store_true",
                      help="run batched and sequential and print the speed-up")
    tp.add_argument("--random-output-len", action="store_true",
                    help="each request's output length uniform in [1, 2 x --output-len - 1] "
                         "(mean --output-len) instead of exactly --output-len")
    tp.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    _add_engine_flags(tp)
    tp.set_defaults(func=cmd_bench_throughput)


def _add_bench_serve(kinds: Any, common: argparse.ArgumentParser) -> None:
    sv = kinds.add_parser("serve", parents=[common],
                          help="load-test an OpenAI-compatible server (streaming)")
    sv.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", required=True, help="model id the server serves")
    sv.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    sv.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    load = sv.add_argument_group("load")
    load.add_argument("--concurrency", type=_int_list, default=(1,),
                      help="concurrent requests at most; a list sweeps (default 1)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps: 1 Poisson, < 1 burstier (default 1)")
    load.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency")
    work = sv.add_argument_group("workload (every concurrency level gets prompts of its own)")
    work.add_argument("--workload", choices=("random", "shared-prefix", "jsonl"),
                      default="random", help="random: unrelated random-token prompts; "
                      "shared-prefix: one common prefix per level, to measure prefix caching")
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    work.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    work.add_argument("--shared-prefix-len", type=int, default=512,
                      help="tokens of the common prefix of --workload shared-prefix")
    work.add_argument("--dataset", metavar="FILE.jsonl",
                      help='--workload jsonl: lines {"prompt": ..., "output_len"?: N}')
    work.add_argument("--tokenizer-model", help="tokenizer for prompts (catalog name, .gguf or "
                      "folder); default: --model's own when llmserve knows it, else the "
                      "server's /tokenize")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--structured", choices=("json_schema", "json_object", "regex", "choice"),
                      help="constrain every output: json_schema (a nested object schema), "
                           "json_object (response_format), regex or choice (vLLM's "
                           "structured_outputs); outputs end when complete (<= --output-len)")
    out = sv.add_argument_group("results")
    out.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT, seconds")
    out.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT, seconds")
    out.add_argument("--output-json", metavar="FILE", help="write every field as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="plot TTFT and tokens/s (needs "
                     "--output-json)")
    out.add_argument("--label", help="name of this server in the results and plots")
    sv.set_defaults(func=cmd_bench_serve)


def _add_bench_latency(kinds: Any, common: argparse.ArgumentParser) -> None:
    lt = kinds.add_parser("latency", parents=[common],
                          help="prefill time, decode TPOT, MBU and MFU on the engine")
    _add_model_flag(lt)
    lt.add_argument("--batch", type=_int_list, default=(1, 8), help="batch sizes (default 1,8)")
    lt.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    lt.add_argument("--output-len", type=int, default=64, help="decode steps (default 64)")
    lt.add_argument("--repeat", type=int, default=3,
                    help="decode runs per batch size, the median TPOT reported (default 3)")
    lt.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    _add_engine_flags(lt)
    lt.set_defaults(func=cmd_bench_latency)


def _add_bench_kernels(kinds: Any, common: argparse.ArgumentParser) -> None:
    kn = kinds.add_parser(
        "kernels", parents=[common],
        help="every linear kernel this CPU could run a model on, timed on its shapes, at the "
             "instruction-set level in use (LLMSERVE_CPU_ISA)")
    _add_model_flag(kn)
    kn.add_argument("--batch", type=_int_list, default=(1, 32),
                    help="batch sizes (default 1,32: decode alone and a serving batch)")
    kn.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    kn.set_defaults(func=cmd_bench_kernels)


def _add_bench_quality(kinds: Any, common: argparse.ArgumentParser) -> None:
    qa = kinds.add_parser(
        "quality", parents=[common],
        help="perplexity, KL and top-1 agreement of a path against the exact float32 path",
        description="Run a fixed English text through the exact float32 path and through "
        "each candidate: the default configuration, then one per --quantization (with "
        "--dtype, --kv-cache-dtype and --engine-arg applied to it).")
    _add_model_flag(qa)
    qa.add_argument("--quantization", nargs="+", metavar="Q",
                    help="candidate quantization methods, one candidate each")
    qa.add_argument("--kv-cache-dtype", help="KV-cache dtype of the candidates")
    qa.add_argument("--dtype", help="compute dtype of the candidates (default auto)")
    qa.add_argument("--engine-arg", action="append", type=_engine_arg, metavar="KEY=VALUE",
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
    qa.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    _add_threads_flag(qa)
    qa.set_defaults(func=cmd_bench_quality)


def _add_bench_spec(kinds: Any, common: argparse.ArgumentParser) -> None:
    sp = kinds.add_parser(
        "spec", parents=[common],
        help="speculative decoding: batch-1 tok/s, acceptance and speedup per method and "
             "path on grounded and chat workloads, and the concurrency where it stops paying")
    _add_model_flag(sp)
    sp.add_argument("--methods", type=_str_list, default=["ngram", "self_draft"],
                    help="methods to compare with none (default ngram,self_draft)")
    sp.add_argument("--paths", type=_str_list, default=["default", "float32"],
                    help="default (quantized) and/or float32 (exact); default both")
    sp.add_argument("--num-speculative-tokens", type=int, default=4,
                    help="most drafts per step (default 4)")
    sp.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    sp.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8, 16, 32),
                    help="concurrencies for the crossover (default 1,2,4,8,16,32; 0: skip)")
    sp.add_argument("--crossover-method", choices=("ngram", "self_draft"), default="ngram",
                    help="the method of the concurrency sweep (default ngram)")
    sp.add_argument("--crossover-path", choices=("default", "float32"), default="default",
                    help="the path of the concurrency sweep (default: default)")
    sp.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    _add_threads_flag(sp)
    sp.set_defaults(func=cmd_bench_spec)


def _add_bench_scaling(kinds: Any, common: argparse.ArgumentParser) -> None:
    sc = kinds.add_parser(
        "scaling", parents=[common],
        help="tensor parallelism (tok/s vs TP=1, collectives' share of the time) and "
             "disaggregated prefill/decode (KV bytes and time on the wire per prompt)")
    _add_model_flag(sc)
    sc.add_argument("--dtype", default="auto", help="auto (default) or float32")
    sc.add_argument("--tensor-parallel-sizes", type=_int_list, default=(1, 2),
                    help="sizes to compare (default 1,2)")
    sc.add_argument("--batch", type=_int_list, default=(1, 8),
                    help="concurrent prompts (default 1,8)")
    sc.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    sc.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    sc.add_argument("--prompt-lens", type=_int_list, default=(128, 512, 1024, 2000),
                    help="prompt lengths whose KV is transferred (default 128,512,1024,2000; "
                         "0: skip)")
    sc.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    sc.set_defaults(func=cmd_bench_scaling)


def _add_bench_soak(kinds: Any, common: argparse.ArgumentParser) -> None:
    from llmserve.bench.soak import parse_duration

    duration = _parsed(parse_duration)
    so = kinds.add_parser(
        "soak", parents=[common],
        help="hours of streamed load on one server, sampled for leaks: RSS slope, KV usage "
             "at the end, latency percentiles over time")
    target = so.add_argument_group("server (default: start `llmserve serve` on a free port)")
    target.add_argument("--base-url", help="soak this running server instead")
    target.add_argument("--server-pid", type=int,
                        help="with --base-url: the process whose tree's RSS is sampled")
    target.add_argument("--model", help="model to serve (default: serve's default); with "
                        "--base-url the served id (default: the first of /v1/models)")
    target.add_argument("--server-args", metavar="'FLAGS'",
                        help="more flags for the started server, e.g. '--threads 2'")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    load = so.add_argument_group("load")
    load.add_argument("--duration", type=duration, default=1800.0,
                      help="how long clients send, e.g. 20s, 30m, 2h (default 30m)")
    load.add_argument("--concurrency", type=int, default=32, help="streams at once (default 32)")
    load.add_argument("--disconnect-fraction", type=float, default=0.05,
                      help="requests hung up on mid-stream (default 0.05)")
    load.add_argument("--input-len", type=_int_range, default=(16, 512), metavar="LOW:HIGH",
                      help="prompt tokens, uniform (default 16:512)")
    load.add_argument("--output-len", type=_int_range, default=(16, 256), metavar="LOW:HIGH",
                      help="output tokens, uniform (default 16:256)")
    load.add_argument("--seed", type=int, default=0)
    out = so.add_argument_group("sampling and results")
    out.add_argument("--sample-interval", type=duration, default=10.0,
                     help="between samples (default 10s)")
    out.add_argument("--warmup", type=duration, default=60.0,
                     help="left out of the RSS slope (default 1m)")
    out.add_argument("--output-json", metavar="FILE", help="write the samples and summary")
    out.add_argument("--plot", metavar="FILE.png", help="plot the samples (needs --output-json)")
    so.set_defaults(func=cmd_bench_soak)


def _add_bench_plot(kinds: Any, common: argparse.ArgumentParser) -> None:
    pl = kinds.add_parser("plot", parents=[common],
                          help="plot `bench serve` result files against each other")
    pl.add_argument("results", nargs="+", metavar="RESULT.json")
    pl.add_argument("--output", required=True, metavar="FILE.png")
    pl.set_defaults(func=cmd_bench_plot)


def _add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", dest="num_threads", type=int,
                        help="compute threads (default: all cores)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None


def _int_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH like 16:512, got {text!r}") from None


def _parsed(parse: Any) -> Any:
    """An argparse type from a parser that raises ValueError with the message to show."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip().replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.strip().replace("-", "_"), value
