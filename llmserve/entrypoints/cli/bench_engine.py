"""`llmserve bench throughput`, `latency`, `kernels` and `scaling`: how fast the engine runs a
model in this process, and where the time goes."""

import argparse
import sys

from llmserve.entrypoints.cli.args import add_engine_flags, add_model_flag, int_list, make_llm
from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.cli.output import write_json


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
    llm = make_llm(args)
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
    llm = make_llm(args)
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
    from llmserve.bench.kernels import decided_while_busy, format_kernels, run_kernels
    from llmserve.loader.catalog import resolve_model
    from llmserve.loader.model_loader import read_model_config

    if min(args.batch) < 1:
        raise ValueError("--batch takes positive integers, e.g. 1,32")
    source = resolve_model(args.model)
    stored, block_type = "int4", "Q4_K"  # a float or HF checkpoint: its quantized paths
    if source.kind == "gguf":
        from llmserve.loader.gguf import gguf_main_block_type, gguf_stored_quantization

        stored = gguf_stored_quantization(source.path) or "int4"
        block_type = gguf_main_block_type(source.path)
    result = run_kernels(read_model_config(source), tuple(args.batch), stored, block_type,
                         retime=args.retime)
    print(format_kernels(result))
    if args.output_json:
        write_json(args.output_json, result)
    if args.retime and decided_while_busy(result):
        print("--retime: the machine was busy while timing; what it decided then was not "
              "cached (the cached decisions stand): run it again when the machine is quiet",
              file=sys.stderr)
        return 1
    return 0


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from llmserve.bench.scaling import run_scaling_bench
    from llmserve.cpu_info import load_average_1m
    from llmserve.entrypoints.cli.bench_server import machine_header

    if any(size < 1 for size in args.tensor_parallel_sizes + args.pipeline_parallel_sizes):
        raise ValueError("--tensor-parallel-sizes and --pipeline-parallel-sizes must be at "
                         "least 1")
    _, bandwidth, load_before = machine_header()
    layouts = [(tp, pp) for pp in args.pipeline_parallel_sizes
               for tp in args.tensor_parallel_sizes]
    data = run_scaling_bench(args.model, args.dtype, layouts, args.batch,
                             args.input_len, args.output_len,
                             [n for n in args.prompt_lens if n > 0],
                             log=lambda line: print(line, flush=True))
    load_after = load_average_1m()
    print(f"load average (1 min) after: {load_after}", flush=True)
    data.update(read_bandwidth_bytes_per_s=bandwidth, load_average_before=load_before,
                load_average_after=load_after)
    if args.output_json:
        write_json(args.output_json, data)
    return 0


def _throughput_arguments(tp: argparse.ArgumentParser) -> None:
    add_model_flag(tp)
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
    add_engine_flags(tp)


def _latency_arguments(lt: argparse.ArgumentParser) -> None:
    add_model_flag(lt)
    lt.add_argument("--batch", type=int_list, default=(1, 8), help="batch sizes (default 1,8)")
    lt.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    lt.add_argument("--output-len", type=int, default=64, help="decode steps (default 64)")
    lt.add_argument("--repeat", type=int, default=3,
                    help="decode runs per batch size, the median TPOT reported (default 3)")
    lt.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    add_engine_flags(lt)


def _kernels_arguments(kn: argparse.ArgumentParser) -> None:
    add_model_flag(kn)
    kn.add_argument("--batch", type=int_list, default=(1, 32),
                    help="batch sizes (default 1,32: decode alone and a serving batch)")
    kn.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    kn.add_argument("--retime", action="store_true",
                    help="decide again now what the engine runs for this model (the linears' "
                         "format, the attention backend) and replace the cached decisions; "
                         "refused while the machine is busy")


def _scaling_arguments(sc: argparse.ArgumentParser) -> None:
    add_model_flag(sc)
    sc.add_argument("--dtype", default="auto", help="auto (default) or float32")
    sc.add_argument("--tensor-parallel-sizes", type=int_list, default=(1, 2),
                    help="sizes to compare (default 1,2)")
    sc.add_argument("--pipeline-parallel-sizes", type=int_list, default=(1,),
                    help="pipeline stages to compare, each with every tensor-parallel size "
                         "(default 1)")
    sc.add_argument("--batch", type=int_list, default=(1, 8),
                    help="concurrent prompts (default 1,8)")
    sc.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    sc.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    sc.add_argument("--prompt-lens", type=int_list, default=(128, 512, 1024, 2000),
                    help="prompt lengths whose KV is transferred (default 128,512,1024,2000; "
                         "0: skip)")
    sc.add_argument("--output-json", metavar="FILE", help="write the results as JSON")


THROUGHPUT = Command("throughput",
                     help="offline throughput of synthetic prompts through LLM.generate",
                     add_arguments=_throughput_arguments, run=cmd_bench_throughput)
LATENCY = Command("latency", help="prefill time, decode TPOT, MBU and MFU on the engine",
                  add_arguments=_latency_arguments, run=cmd_bench_latency)
KERNELS = Command(
    "kernels", help="every linear kernel this CPU could run a model on, timed on its shapes, "
    "at the instruction-set level in use (LLMSERVE_CPU_ISA)",
    add_arguments=_kernels_arguments, run=cmd_bench_kernels)
SCALING = Command(
    "scaling", help="tensor parallelism (tok/s vs TP=1, collectives' share of the time) and "
    "disaggregated prefill/decode (KV bytes and time on the wire per prompt)",
    add_arguments=_scaling_arguments, run=cmd_bench_scaling)
