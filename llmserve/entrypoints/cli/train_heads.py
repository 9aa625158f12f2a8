"""`llmserve train-heads`: train Medusa heads or an EAGLE head for a model on this
machine's CPU, by self-distillation, and write them where `speculative_config` reads them.

The target answers prompts greedily (a built-in set, or the paragraphs of `--data` as
texts to continue), its hidden states at every position of its answers are taken, and
the heads learn the tokens that follow (`spec_decode/training.py`, `eagle_training.py`).
The output folder is vLLM's Medusa layout sharing the target's LM head, or an EAGLE-1
head with a draft vocabulary (EAGLE-3's `d2t`), with how it was made (data size, times,
the held-out tokens per round) in its config.json under "llmserve":

    llmserve train-heads --model smollm2-135m --output heads/
    llmserve serve --speculative-config '{"method": "medusa", "model": "heads/"}'
    llmserve train-heads --model smollm2-135m --method eagle --output eagle/
    llmserve serve --speculative-config '{"method": "eagle", "model": "eagle/"}'
"""

import argparse
import hashlib
import importlib.resources
import sys
import time
from pathlib import Path

from llmserve.entrypoints.cli.args import add_model_flag
from llmserve.entrypoints.cli.command import Command
from llmserve.errors import LLMServeError

BUILT_IN_PROMPTS = "data/train_prompts.txt"  # in llmserve.spec_decode
PROMPT_OPENINGS = "data/prompt_openings.txt"  # how --self-prompts begin the user's turn
DEFAULTS = {"medusa": {"steps": 600, "batch_size": 64, "lr": 1e-3},
            "eagle": {"steps": 400, "batch_size": 4, "lr": 3e-4}}


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


def prompt_openings() -> list[str]:
    text = importlib.resources.files("llmserve.spec_decode").joinpath(PROMPT_OPENINGS)
    return [line.strip() for line in text.read_text("utf-8").splitlines() if line.strip()]


def prompt_run_seed(seed: int, attempt: int, opening: int) -> int:
    """The seed of --self-prompts' samples for one opening and try (the k-th sample takes
    it + k): a hash of the three, far from every other's, so that each --seed writes
    prompts of its own (seed + 1000 x opening + k had --seed 1 sample almost all of
    --seed 0's prompts again, one place on)."""
    digest = hashlib.sha256(f"{seed}/{attempt}/{opening}".encode()).digest()
    return int.from_bytes(digest[:5], "little") << 16  # < 2^56: room for 65,536 samples


def self_prompts(llm, count: int, temperature: float, seed: int) -> list[str]:
    """`count` distinct prompts the target writes itself (Magpie: its chat template up to
    the user's turn, sampled until the turn ends), each begun with one of the built-in
    openings in turn (a story, an email, an explanation, tips, code, ...: left to itself a
    small model asks for advice again and again) and finished by the target; unfinished
    ones (cut by the length) and repeats are dropped, so a few more are asked than kept."""
    from llmserve.sampling_params import SamplingParams

    sentinel = "\x07prompt\x07"
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": sentinel}],
                                             add_generation_prompt=False)
    if sentinel not in text:
        raise LLMServeError("--self-prompts: the model's chat template does not show the "
                            "user's message as written")
    openings = prompt_openings()
    turn = text[:text.index(sentinel)]
    starts = [llm.tokenizer.encode(turn + o, add_special_tokens=False) for o in openings]
    found: list[list[str]] = [[] for _ in openings]  # per opening, in the order written
    seen: set[str] = set()
    for attempt in range(4):
        have = sum(len(f) for f in found)
        each = -(-max(8, (count - have) * 5 // 4) // len(openings))
        runs = [(o, SamplingParams(n=min(64, each - i), top_p=0.95, temperature=temperature,
                                   max_tokens=96, seed=prompt_run_seed(seed, attempt, o) + i))
                for o in range(len(openings)) for i in range(0, each, 64)]
        outs = llm.generate([{"prompt_token_ids": starts[o]} for o, _ in runs],
                            [params for _, params in runs], use_tqdm=False)
        for (o, _), out in zip(runs, outs, strict=True):
            for c in out.outputs:
                prompt = (openings[o] + c.text).strip()
                if (c.finish_reason == "stop" and len(c.text.strip()) >= 4
                        and prompt not in seen):
                    seen.add(prompt)
                    found[o].append(prompt)
        if sum(len(f) for f in found) >= count:
            break
    # the openings in turn, so that a cut keeps them as even as they came
    prompts = [f[i] for i in range(max(map(len, found))) for f in found if i < len(f)]
    if len(prompts) < count:
        raise LLMServeError(f"--self-prompts: the model wrote {len(prompts)} usable prompts "
                            f"of {count} in four tries")
    return prompts[:count]


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from llmserve.llm import LLM
    from llmserve.spec_decode.eagle_training import (
        draft_vocabulary,
        eagle_sequences,
        resume_eagle,
        save_eagle_head,
        train_eagle,
    )
    from llmserve.spec_decode.medusa import HeadsFormatError, save_medusa_heads
    from llmserve.spec_decode.training import (
        load_answers,
        save_answers,
        split_held_out,
        train_medusa,
        training_dtype,
    )

    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise LLMServeError(f"--output {output} is a file, not a folder")
    torch.manual_seed(args.seed)
    # no prefix caching: a cached prefix is never computed, so its hidden states are not seen
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              num_threads=args.threads, enable_prefix_caching=False)
    hidden_size = llm.engine.loaded.config.hidden_size
    if args.dataset is not None:
        # several files: their answers together (a prompt two files share is held out
        # in both or in neither: `split_held_out`)
        answers, sources = [], []
        for path in args.dataset:
            try:
                more, meta = load_answers(path, hidden_size)
            except ValueError as e:
                raise LLMServeError(f"--dataset {e}") from None
            answers += more
            sources.append(f"{path} ({meta.get('source', 'a saved dataset')})")
        source = " + ".join(sources)
        generating = 0.0
    else:
        source, answers, generating = _answers(llm, args)
        if args.save_dataset is not None:
            save_answers(answers, args.save_dataset, {"source": source})
    train, held_out = split_held_out(answers, args.held_out)
    if not train:
        raise LLMServeError("no answers to train on (give more prompts or a smaller "
                            "--held-out)")

    # 3. the heads
    lm_head = _lm_head_weight(llm)
    steps = args.steps or DEFAULTS[args.method]["steps"]
    batch_size = args.batch_size or DEFAULTS[args.method]["batch_size"]
    lr = args.lr or DEFAULTS[args.method]["lr"]
    dtype = training_dtype(args.train_dtype)
    bar = tqdm(total=steps, desc="training", file=sys.stderr)

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    info = {"method": args.method, "target": llm.engine.loaded.source.name, "data": source,
            "answers": len(answers), "answer_tokens": sum(len(a.tokens) - a.first
                                                          for a in answers),
            "steps": steps, "batch_size": batch_size, "lr": lr,
            "seed": args.seed, "train_dtype": str(dtype).removeprefix("torch."),
            "command": "llmserve " + " ".join(args.argv)}
    if args.method == "eagle":
        embed = _embedding(llm, lm_head)
        target = llm.engine.loaded.config
        init = None
        if args.init is not None:
            try:
                init, vocabulary = resume_eagle(args.init, target, lm_head, embed)
            except HeadsFormatError as e:
                raise LLMServeError(f"--init {e}") from None
            info["init"] = str(args.init)
        else:
            vocabulary = draft_vocabulary(train, lm_head, embed, args.draft_vocab)
        info["draft_vocab_size"] = len(vocabulary.ids)

        def checkpoint(head, step: int) -> None:
            save_eagle_head(head, vocabulary, target, output, info | {"checkpoint_step": step},
                            args.compact)

        info["unroll"] = args.unroll
        # as many greedy training answers as held-out ones: the figure beside it
        measured = [a for a in train if not a.sampled][:max(len(held_out), 1)]
        result = train_eagle(eagle_sequences(train, embed), eagle_sequences(held_out, embed),
                             target, vocabulary, steps, batch_size, lr, args.num_heads,
                             args.seed, progress, checkpoint, args.checkpoint_every,
                             args.unroll, eagle_sequences(measured, embed), dtype, init)
        info["train_tokens_per_round"] = round(result.train_tokens_per_round or 1.0, 3)
    else:
        def checkpoint(heads, step: int) -> None:
            save_medusa_heads(heads, output, info | {"checkpoint_step": step})

        result = train_medusa(train, held_out, lm_head, args.num_heads, steps, batch_size,
                              lr, args.seed, progress, checkpoint, args.checkpoint_every,
                              dtype)
    bar.close()
    info |= {"train_positions": result.train_positions,
             "held_out_positions": result.held_out_positions,
             "seconds_generating": round(generating, 1),
             "seconds_training": round(result.seconds, 1),
             "final_loss": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4),
             "held_out_tokens_per_round": round(result.held_out_tokens_per_round, 3),
             "held_out_accuracy": [round(a, 3) for a in result.held_out_accuracy]}
    if args.method == "eagle":
        save_eagle_head(result.head, result.vocabulary, llm.engine.loaded.config, output, info,
                        args.compact)
        what, accuracy = (f"an EAGLE head ({len(result.vocabulary.ids)} draft tokens)",
                          "rounds reaching each depth")
    else:
        save_medusa_heads(result.heads, output, info)
        what, accuracy = f"{args.num_heads} Medusa heads", "head accuracy"
    size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    print(f"wrote {what} ({size / 2**20:.1f} MiB) to {output}\n"
          f"data: {len(answers)} answers from {source}, {info['answer_tokens']} answer tokens "
          f"({result.train_positions} training positions, {result.held_out_positions} "
          f"held out)\n"
          f"time: {generating:.0f} s answering (hidden states taken as it answered), "
          f"{result.seconds:.0f} s training ({steps} steps)\n"
          f"held out: {result.held_out_tokens_per_round:.2f} tokens per round drafting "
          f"{args.num_heads}; {accuracy} "
          f"{', '.join(f'{a:.2f}' for a in result.held_out_accuracy)}"
          + (f" (on training answers: {info['train_tokens_per_round']:.2f} tokens per round)"
             if "train_tokens_per_round" in info else "") + "\n"
          f"use: --speculative-config '{{\"method\": \"{args.method}\", \"model\": "
          f"\"{output}\"}}'")
    return 0


def _answers(llm, args: argparse.Namespace):
    """The target's answers (`--samples` per prompt: the first greedy, the others sampled)
    with its hidden states, taken while it answers (`HiddenRecorder`): (source, answers,
    seconds generating). An answer's last token was never fed to the target, so it ends
    one token short of what the target wrote."""
    from llmserve.sampling_params import SamplingParams
    from llmserve.spec_decode.training import Answer, HiddenRecorder

    start = time.perf_counter()
    runs = [SamplingParams(temperature=0, max_tokens=args.max_tokens)]
    runs += [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed + j) for j in range(1, args.samples)]
    if args.data is None:
        source = "built-in prompts"
        prompts = built_in_prompts()
        if args.self_prompts:
            prompts += self_prompts(llm, args.self_prompts, 1.0, args.seed)
            source += f" and {args.self_prompts} the target wrote"
        conversations = [[{"role": "user", "content": p}] for p in prompts]

        def answer(params):
            return llm.chat(conversations, params, use_tqdm=True)
    else:
        source = str(args.data)
        texts = data_prompts(Path(args.data))
        ids = [llm.tokenizer.encode(t)[-args.max_prompt_tokens:] for t in texts]

        def answer(params):
            return llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=True)
    if args.dtype != "float32":
        source += " (answered on the default quantized path)"
    if args.samples > 1:
        source += f", {args.samples} answers each (1 greedy, the rest at temperature "
        source += f"{args.temperature})"
    runner = llm.engine.executor.runner
    recorder, before = HiddenRecorder(), runner.proposer
    runner.proposer = recorder
    answers = []
    try:
        for run, params in enumerate(runs):
            for i, out in enumerate(answer(params)):
                tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                count = len(tokens) - 1  # the last token's hidden state was never computed
                answers.append(Answer(tokens[:count], recorder.take(out.request_id, count),
                                      len(out.prompt_token_ids), i, run > 0))
    finally:
        runner.proposer = before
    return source, answers, time.perf_counter() - start


def _embedding(llm, lm_head):
    """The target's embedding rows of token ids as float32 (a tied model's: its LM head),
    out of inference mode."""
    import torch

    model = llm.engine.loaded.model
    if getattr(model, "lm_head", None) is None:
        return lambda ids: lm_head[torch.as_tensor(ids, dtype=torch.long)]

    def embed(ids):
        with torch.inference_mode():
            rows = model.model.embed_tokens(torch.as_tensor(ids, dtype=torch.long))
        return rows.float().clone()

    return embed


def _lm_head_weight(llm):
    """The target's LM head as a float (V, H) matrix (tied: the embedding), unpacked or
    dequantized from the format the engine keeps it in."""
    import torch

    from llmserve.spec_decode.eagle import target_lm_head_rows
    from llmserve.spec_decode.medusa import HeadsFormatError

    try:
        return target_lm_head_rows(llm.engine.loaded.model,
                                   torch.arange(llm.engine.loaded.config.vocab_size))
    except HeadsFormatError:
        raise LLMServeError("train-heads needs the target's LM head as a float matrix; "
                            f"{llm.engine.loaded.source.name} keeps it in a format it "
                            "cannot unpack") from None


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument("--output", required=True, metavar="FOLDER",
                        help="where the heads go (config.json, model.safetensors)")
    parser.add_argument("--method", choices=list(DEFAULTS), default="medusa",
                        help="the kind of heads (default medusa)")
    parser.add_argument("--data", metavar="FILE.txt",
                        help="texts for the target to continue, one per paragraph "
                             "(default: its answers to a built-in set of 64 prompts)")
    parser.add_argument("--self-prompts", type=int, default=0, metavar="N",
                        help="also answer N prompts the target writes itself from its chat "
                             "template's user turn (more, and more varied, data)")
    parser.add_argument("--samples", type=int, default=1,
                        help="answers per prompt: the first greedy, the others sampled at "
                             "--temperature (default 1)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="the sampled answers' temperature (default 0.8)")
    parser.add_argument("--save-dataset", metavar="FILE.safetensors",
                        help="also write the answers and hidden states here")
    parser.add_argument("--dataset", metavar="FILE.safetensors", action="append",
                        help="train on answers a --save-dataset run wrote (no generating); "
                             "again for more files, their answers together")
    parser.add_argument("--num-heads", type=int, default=4,
                        help="the most drafts a round (Medusa: its heads; EAGLE: the "
                             "held-out chains' length) (default 4)")
    parser.add_argument("--unroll", type=int, default=3,
                        help="EAGLE: chain steps trained from the head's own features, the "
                             "first teacher-forced (default 3; 1 is EAGLE-1's recipe)")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="EAGLE: the answers' most frequent tokens it drafts over "
                             "(default 8192)")
    parser.add_argument("--init", metavar="FOLDER",
                        help="EAGLE: go on training this head (one train-heads wrote, full "
                             "or --compact; its draft vocabulary kept) instead of a new one")
    parser.add_argument("--compact", action="store_true",
                        help="EAGLE: write the head's matrices in int8 (a scale per row) "
                             "without the draft vocabulary's LM head rows, which are the "
                             "target's (an eighth of the size)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens per answer (default 256)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="with --data: the last this many tokens of a paragraph")
    parser.add_argument("--steps", type=int,
                        help="training steps (default 600 Medusa, 400 EAGLE)")
    parser.add_argument("--batch-size", type=int,
                        help="a step's batch: Medusa positions (default 64), EAGLE whole "
                             "answers (default 4)")
    parser.add_argument("--lr", type=float,
                        help="peak learning rate (default 1e-3 Medusa, 3e-4 EAGLE)")
    parser.add_argument("--held-out", type=float, default=0.1,
                        help="share of the answers kept to measure acceptance (default 0.1)")
    parser.add_argument("--checkpoint-every", type=int, default=200,
                        help="write the heads every this many steps (default 200)")
    parser.add_argument("--train-dtype", choices=("auto", "float32", "bfloat16"),
                        default="auto",
                        help="the training's matrix products: auto is bfloat16 where the CPU "
                             "has bf16 matrix instructions (AMX, AVX512-BF16), else float32")
    parser.add_argument("--dtype", choices=("float32", "auto"), default="float32",
                        help="the path the target answers on: float32, the exact one "
                             "(default), or auto, the default quantized one (3.1x the "
                             "answers a minute on a 2-core Zen 3; a head trained on either "
                             "drafts for both)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads (default: the cores)")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="the target's KV cache while it answers (default 1GiB)")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("num_heads", "max_tokens", "max_prompt_tokens", "steps", "batch_size",
                 "checkpoint_every", "draft_vocab", "samples", "unroll"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.held_out < 1:
        parser.error("--held-out must be in [0, 1)")
    if args.lr is not None and args.lr <= 0:
        parser.error("--lr must be positive")
    if args.temperature <= 0:
        parser.error("--temperature must be positive (the first answer is the greedy one)")
    if args.dataset is not None and args.data is not None:
        parser.error("--dataset holds answers already: --data goes with generating them")
    if args.self_prompts < 0:
        parser.error("--self-prompts must be at least 0")
    if args.self_prompts and (args.data is not None or args.dataset is not None):
        parser.error("--self-prompts adds to the built-in prompts: not with --data or "
                     "--dataset")
    if args.init is not None and args.method != "eagle":
        parser.error("--init is for --method eagle")
    if args.compact and args.method != "eagle":
        parser.error("--compact is for --method eagle (Medusa heads share the target's LM "
                     "head already)")


COMMAND = Command("train-heads", help="train Medusa or EAGLE heads for a model (speculative "
                                      "decoding)",
                  add_arguments=_arguments, run=cmd_train_heads, check=_check,
                  description=__doc__.splitlines()[0])
