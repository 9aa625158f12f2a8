"""`llmserve memory`: a model's weight and KV-cache memory, and what fits (the arithmetic
is in `memory_report.py`)."""

import argparse

from llmserve.config.engine import QUANTIZATION_CHOICES
from llmserve.entrypoints.cli.args import add_model_flag, kv_cache_memory
from llmserve.entrypoints.cli.command import Command


def cmd_memory(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli.memory_report import memory_report

    link = None
    if (args.link_gbit is None) != (args.link_latency_ms is None):
        raise ValueError("--link-gbit and --link-latency-ms go together")
    if args.link_gbit is not None:
        if args.link_gbit <= 0 or args.link_latency_ms < 0:
            raise ValueError("--link-gbit must be positive and --link-latency-ms not negative")
        link = (args.link_gbit * 1e9 / 8, args.link_latency_ms / 1e3)
    if args.pipeline_parallel_size < 1 or args.tensor_parallel_size < 1:
        raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be at "
                         "least 1")
    print(memory_report(args.model, args.batch, args.seq_len, args.dtype, args.kv_dtype,
                        args.kv_cache_memory, args.block_size, args.device,
                        args.quantization, args.tensor_parallel_size,
                        args.pipeline_parallel_size, link,
                        None if args.read_gbps is None else args.read_gbps * 1e9,
                        args.tensor_across_hosts))
    return 0


def _arguments(mem: argparse.ArgumentParser) -> None:
    add_model_flag(mem)
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
    mem.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="also show each pipeline stage's layers, weights and KV (default 1)")
    mem.add_argument("--link-gbit", type=float, metavar="GBIT_S",
                     help="the link between hosts (one stage on each): its rate in Gbit/s "
                          "(iperf3 measures it); with --link-latency-ms, plan a decode step")
    mem.add_argument("--link-latency-ms", type=float, metavar="MS",
                     help="the link's one-way latency in ms (half of ping's round trip)")
    mem.add_argument("--read-gbps", type=float, metavar="GB_S",
                     help="each host's memory read bandwidth in GB/s (default: measured on "
                          "this machine now)")
    mem.add_argument("--tensor-across-hosts", action="store_true",
                     help="the tensor-parallel ranks too are on different hosts (their "
                          "exchanges cross the link, two a layer)")


COMMAND = Command("memory", help="weights and KV-cache memory of a model, and what fits",
                  add_arguments=_arguments, run=cmd_memory)
