"""`llmserve memory`: a model's weight and KV-cache memory, and what fits (the arithmetic
is in `memory_report.py`)."""

import argparse

from llmserve.config.engine import QUANTIZATION_CHOICES
from llmserve.entrypoints.cli.args import add_model_flag, kv_cache_memory
from llmserve.entrypoints.cli.command import Command


def cmd_memory(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.cli.memory_report import memory_report

    print(memory_report(args.model, args.batch, args.seq_len, args.dtype, args.kv_dtype,
                        args.kv_cache_memory, args.block_size, args.device,
                        args.quantization, args.tensor_parallel_size))
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


COMMAND = Command("memory", help="weights and KV-cache memory of a model, and what fits",
                  add_arguments=_arguments, run=cmd_memory)
