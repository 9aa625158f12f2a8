"""`llmserve train-heads`: train Medusa heads for a model on this machine's CPU, by
self-distillation, and write them where `speculative_config` reads them.

The target answers prompts greedily (a built-in set, or the paragraphs of `--data` as
texts to continue), its hidden states at every position of its answers are taken, and
the heads learn the tokens that follow (`spec_decode/training.py`). The output folder is
vLLM's Medusa layout sharing the target's LM head, with how it was made (data size,
times, the held-out tokens per round) in its config.json under "llmserve":

    llmserve train-heads --model smollm2-135m --output heads/
    llmserve serve --speculative-config '{"method": "medusa", "model": "heads/"}'
"""

import argparse
import importlib.resources
import sys
import time
from pathlib import Path

from llmserve.entrypoints.cli.args import add_model_flag
from llmserve.entrypoints.cli.command import Command
from llmserve.errors import LLMServeError

BUILT_IN_PROMPTS = "data/train_prompts.txt"  # in llmserve.spec_decode


def built_in_prompts() -> list[str]:
    text = importlib.resources.files("llmserve.spec_decode").joinpath(BUILT_IN_PROMPTS)
    return [line.strip() for line in text.read_text("utf-8").splitlines() if line.strip()]


def data_prompts(path: Path) -> list[str]:
    """The paragraphs of a text file (blank-line separated), each a text to continue."""
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LLMServeError(f"--data {path}: {e}") from None
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        raise LLMServeError(f"--data {path} holds no text")
    return paragraphs


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from llmserve.bench.quality import full_hidden_states
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams
    from llmserve.spec_decode.medusa import save_medusa_heads
    from llmserve.spec_decode.training import Answer, train_medusa

    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise LLMServeError(f"--output {output} is a file, not a folder")
    torch.manual_seed(args.seed)
    llm = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory,
              num_threads=args.threads)
    tokenizer = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    # 1. the target's own answers
    start = time.perf_counter()
    if args.data is None:
        source = "built-in prompts"
        prompts = built_in_prompts()
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=True)
    else:
        source = str(args.data)
        texts = data_prompts(Path(args.data))
        prompts = [tokenizer.encode(t)[-args.max_prompt_tokens:] for t in texts]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                               use_tqdm=True)
    generating = time.perf_counter() - start

    # 2. its hidden states over them
    start = time.perf_counter()
    answers = []
    for out in tqdm(outputs, desc="hidden states", file=sys.stderr):
        prompt = list(out.prompt_token_ids)
        tokens = prompt + list(out.outputs[0].token_ids)
        hidden = full_hidden_states(llm, tokens).clone().float().cpu()  # out of inference
        answers.append(Answer(tokens, hidden, len(prompt)))
    hidden_seconds = time.perf_counter() - start
    every = max(2, round(1 / args.held_out)) if args.held_out > 0 else 0
    kept = {i for i in range(len(answers)) if every and i % every == every - 1}
    held_out = [a for i, a in enumerate(answers) if i in kept]
    train = [a for i, a in enumerate(answers) if i not in kept]
    if not train:
        raise LLMServeError("no answers to train on (give more prompts or a smaller "
                            "--held-out)")

    # 3. the heads
    lm_head = _lm_head_weight(llm)
    bar = tqdm(total=args.steps, desc="training", file=sys.stderr)

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    info = {"method": "medusa", "target": llm.engine.loaded.source.name, "data": source,
            "answers": len(answers), "answer_tokens": sum(len(a.tokens) - a.first
                                                          for a in answers),
            "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "command": "llmserve " + " ".join(args.argv)}

    def checkpoint(heads, step: int) -> None:
        save_medusa_heads(heads, output, info | {"checkpoint_step": step})

    result = train_medusa(train, held_out, lm_head, args.num_heads, args.steps,
                          args.batch_size, args.lr, args.seed, progress, checkpoint,
                          args.checkpoint_every)
    bar.close()
    info |= {"train_positions": result.train_positions,
             "held_out_positions": result.held_out_positions,
             "seconds_generating": round(generating, 1),
             "seconds_hidden_states": round(hidden_seconds, 1),
             "seconds_training": round(result.seconds, 1),
             "final_loss": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4),
             "held_out_tokens_per_round": round(result.held_out_tokens_per_round, 3),
             "held_out_accuracy": [round(a, 3) for a in result.held_out_accuracy]}
    save_medusa_heads(result.heads, output, info)
    size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    print(f"wrote {args.num_heads} Medusa heads ({size / 2**20:.1f} MiB) to {output}\n"
          f"data: {len(answers)} answers from {source}, {info['answer_tokens']} answer tokens "
          f"({result.train_positions} training positions, {result.held_out_positions} "
          f"held out)\n"
          f"time: {generating:.0f} s generating, {hidden_seconds:.0f} s hidden states, "
          f"{result.seconds:.0f} s training ({args.steps} steps)\n"
          f"held out: {result.held_out_tokens_per_round:.2f} tokens per round with every "
          f"head drafting; head accuracy "
          f"{', '.join(f'{a:.2f}' for a in result.held_out_accuracy)}\n"
          f"use: --speculative-config '{{\"method\": \"medusa\", \"model\": \"{output}\"}}'")
    return 0


def _lm_head_weight(llm):
    """The target's LM head as a float (V, H) matrix (tied: the embedding), unpacked or
    dequantized from the format the engine keeps it in."""
    import torch

    model = llm.engine.loaded.model
    head = getattr(model, "lm_head", None)
    weight = head.weight if head is not None else model.model.embed_tokens.weight
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.detach().float()
    if hasattr(weight, "embedding_rows"):
        with torch.inference_mode():
            rows = weight.embedding_rows(torch.arange(llm.engine.loaded.config.vocab_size))
        return rows.float().clone()  # out of inference mode: the training reads it
    raise LLMServeError("train-heads needs the target's LM head as a float matrix; "
                        f"{llm.engine.loaded.source.name} keeps it in a format it cannot "
                        "unpack")


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument("--output", required=True, metavar="FOLDER",
                        help="where the heads go (config.json, model.safetensors)")
    parser.add_argument("--method", choices=["medusa"], default="medusa",
                        help="the kind of heads (default medusa)")
    parser.add_argument("--data", metavar="FILE.txt",
                        help="texts for the target to continue, one per paragraph "
                             "(default: its answers to a built-in set of 64 prompts)")
    parser.add_argument("--num-heads", type=int, default=4,
                        help="heads, the most drafts a round (default 4)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens per answer (default 256)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="with --data: the last this many tokens of a paragraph")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="positions per step (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--held-out", type=float, default=0.1,
                        help="share of the answers kept to measure acceptance (default 0.1)")
    parser.add_argument("--checkpoint-every", type=int, default=200,
                        help="write the heads every this many steps (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads (default: the cores)")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="the target's KV cache while it answers (default 1GiB)")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("num_heads", "max_tokens", "max_prompt_tokens", "steps", "batch_size",
                 "checkpoint_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.held_out < 1:
        parser.error("--held-out must be in [0, 1)")
    if args.lr <= 0:
        parser.error("--lr must be positive")


COMMAND = Command("train-heads", help="train Medusa heads for a model (speculative decoding)",
                  add_arguments=_arguments, run=cmd_train_heads, check=_check,
                  description=__doc__.splitlines()[0])
