"""`llmserve bench embed`: the pooling runner's embeddings per second against
sentence-transformers on the same weights (`bench/embed.py`)."""

import argparse

from llmserve.entrypoints.cli.args import add_model_flag, add_threads_flag, int_list, set_threads
from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.cli.output import write_json


def cmd_bench_embed(args: argparse.Namespace) -> int:
    from llmserve.bench.embed import (
        bench_texts,
        format_table,
        lowest_cosine,
        report,
        run_llmserve,
        run_sentence_transformers,
        sentence_transformer,
    )
    from llmserve.bench.machine import format_machine, machine_info
    from llmserve.llm import LLM

    if args.num_texts < 1 or args.repeat < 1 or min(args.batch, default=0) < 1:
        raise ValueError("--num-texts, --repeat and --batch take positive integers")
    set_threads(args)
    print(format_machine(), flush=True)
    pooler = {"pooling_type": args.pooling_type, "normalize": not args.no_normalize}
    llm = LLM(args.model, dtype=args.dtype, runner="pooling", pooler_config=pooler,
              kv_cache_memory="512MiB", enable_prefix_caching=False)
    st = sentence_transformer(str(llm.engine.loaded.source.path), llm.engine.pooler.config
                              .pooling_type, not args.no_normalize)
    texts = bench_texts(args.num_texts)
    results, cosines = [], {}
    for batch in args.batch:
        ours, ours_vectors = run_llmserve(llm, texts, batch, args.repeat)
        theirs, their_vectors = run_sentence_transformers(st, texts, batch, args.repeat,
                                                          llm.tokenizer)
        results += [ours, theirs]
        cosines[batch] = lowest_cosine(ours_vectors, their_vectors)
    print(format_table(results, cosines))
    if args.output_json:
        options = {"model": args.model, "dtype": args.dtype, "pooler_config": pooler,
                   "num_texts": args.num_texts, "repeat": args.repeat}
        write_json(args.output_json, report(results, cosines, options, machine_info()))
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument("--dtype", default="float32",
                        help="llmserve's dtype (default float32, as sentence-transformers "
                             "runs the checkpoint)")
    parser.add_argument("--pooling-type", choices=("LAST", "MEAN", "CLS"), default="LAST")
    parser.add_argument("--no-normalize", action="store_true",
                        help="raw pooled states (default: L2-normalised)")
    parser.add_argument("--num-texts", type=int, default=128, help="texts (default 128)")
    parser.add_argument("--batch", type=int_list, default=(1, 32),
                        help="batch sizes (default 1,32)")
    parser.add_argument("--repeat", type=int, default=1, help="timed passes (default 1)")
    parser.add_argument("--output-json", metavar="FILE", help="write the results as JSON")
    add_threads_flag(parser)


EMBED = Command(
    "embed", help="embeddings per second of the pooling runner against sentence-transformers "
    "on the same weights (batch 1 and batched), with their lowest cosine",
    add_arguments=_arguments, run=cmd_bench_embed)
