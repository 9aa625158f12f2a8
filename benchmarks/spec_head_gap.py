"""An EAGLE head's chains drafted offline (the training's held-out measure) on the greedy
answers to `bench spec`'s chat prompts, against the engine's tokens a round on the same
prompts (k = 4, no confidence cut): a gap would be a difference between training and
inference.

    python benchmarks/spec_head_gap.py HEAD_FOLDER
"""

import sys

import torch
from safetensors.torch import load_file

from llmserve.bench.spec import CHAT_PROMPTS, chat_token_ids
from llmserve.entrypoints.cli.train_heads import _embedding, _lm_head_weight
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.eagle import EagleProposer
from llmserve.spec_decode.eagle_training import (
    DraftVocabulary,
    TrainableEagle,
    eagle_sequences,
    measure,
)
from llmserve.spec_decode.training import Answer, HiddenRecorder


def main() -> None:
    folder = sys.argv[1]
    prompts = list(CHAT_PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=128)
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory="512MiB",
              enable_prefix_caching=False)
    lm_head = _lm_head_weight(llm)
    embed = _embedding(llm, lm_head)
    tensors = load_file(f"{folder}/model.safetensors")
    head = TrainableEagle(llm.engine.loaded.config)
    head.load_state_dict({k: v for k, v in tensors.items()
                          if k.startswith(("fc.", "layers."))})
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    vocabulary = DraftVocabulary(ids, tensors["lm_head.weight"], embed(ids.tolist()))
    runner = llm.engine.executor.runner
    recorder, before = HiddenRecorder(), runner.proposer
    runner.proposer = recorder
    outs = llm.generate(chat_token_ids(llm, prompts), params, use_tqdm=False)
    runner.proposer = before
    answers = []
    for i, o in enumerate(outs):
        tokens = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        answers.append(Answer(tokens[:-1], recorder.take(o.request_id, len(tokens) - 1),
                              len(o.prompt_token_ids), i, False))
    seqs = eagle_sequences(answers, embed)
    for i, s in enumerate(seqs):
        _, per_round, accuracy = measure(head, vocabulary, [s], 4)
        print(f"prompt {i}: offline {per_round:.2f} tokens a round, depths "
              f"{[round(a, 2) for a in accuracy]}")
    print(f"all: offline {measure(head, vocabulary, seqs, 4)[1]:.2f} tokens a round")
    EagleProposer.min_confidence = 0.0
    spec = {"method": "eagle", "model": folder, "num_speculative_tokens": 4,
            "adaptive": False}
    for dtype in ("float32", "auto"):
        engine = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="512MiB",
                     speculative_config=spec)
        for i, p in enumerate(chat_token_ids(engine, prompts)):
            stats = engine.engine.speculator.stats
            accepted, rounds = stats.num_accepted_tokens, stats.num_drafts
            o = engine.generate([p], params, use_tqdm=False)[0]
            per_round = 1 + (stats.num_accepted_tokens - accepted) / max(
                1, stats.num_drafts - rounds)
            same = list(o.outputs[0].token_ids) == list(outs[i].outputs[0].token_ids)
            print(f"{dtype} prompt {i}: engine {per_round:.2f} tokens a round "
                  f"(output as recorded: {same})")


if __name__ == "__main__":
    main()
