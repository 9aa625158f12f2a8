"""lm-eval's `local-completions` against a live server (float32 path): a multiple-choice
task and a `loglikelihood_rolling` task from local task files, tokenized by the server
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize). lm-eval scores each answer from
the echoed prompt logprobs; every score equals transformers' own log-likelihood of the same
tokens, and the accuracy is the one transformers' scores give."""

import json
import math

import pytest
import torch

from tests.entrypoints.openai.conftest import MODEL

lm_eval = pytest.importorskip("lm_eval")
# lm-eval's import (datasets, pandas) and its task set-up take ~15 s of a 2-core machine; the
# default tier checks the same scores against transformers in test_scoring.py
pytestmark = pytest.mark.slow

LOGLIKELIHOOD_TOLERANCE = 2e-3  # a sum of up to ~40 token logprobs, each within 1e-4
QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"],
     "answer": 0},
    {"question": "Water is made of hydrogen and", "choices": [" oxygen", " gold", " sand"],
     "answer": 0},
    {"question": "One, two, three,", "choices": [" four", " seven", " twelve"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " blue", " loud"], "answer": 0},
]
TEXTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Rivers flow from the mountains down to the sea, carrying sand and stones."},
    {"text": "In 1969, two astronauts walked on the Moon while a third stayed in orbit."},
]
MC_TASK = """task: llmserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
ROLLING_TASK = """task: llmserve_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def evaluation(server, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp("tasks")
    for name, rows, task in (("mc", QUESTIONS, MC_TASK), ("rolling", TEXTS, ROLLING_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(task.format(data=data))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = (f"model={MODEL},base_url={server.base_url}/completions,"
                  "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,"
                  "max_retries=1,max_length=500")
    return simple_evaluate(model="local-completions", model_args=model_args,
                           tasks=["llmserve_mc", "llmserve_rolling"],
                           task_manager=TaskManager(include_path=str(folder)),
                           log_samples=True, random_seed=0, numpy_random_seed=0,
                           torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def reference_loglikelihood(reference_model, context: list[int], continuation: list[int]
                            ) -> tuple[float, bool]:
    """transformers' log-likelihood of `continuation` after `context`, and whether each of
    its tokens is the argmax there."""
    ids = context + continuation
    with torch.inference_mode():
        logprobs = reference_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows = logprobs[len(context) - 1: len(ids) - 1]
    picked = rows.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    greedy = bool((rows.argmax(-1) == torch.tensor(continuation)).all())
    return picked.sum().item(), greedy


def test_multiple_choice_scores_equal_transformers(evaluation, tokenizer, reference_model):
    samples = evaluation["samples"]["llmserve_mc"]
    assert len(samples) == len(QUESTIONS)
    worst, correct = 0.0, 0
    for sample in samples:
        scores = []
        for (context, continuation), ((ours, ours_greedy),) in zip(
                sample["arguments"], sample["resps"], strict=True):
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            context_ids = tokenizer.encode(context, add_special_tokens=False)
            ref, ref_greedy = reference_loglikelihood(reference_model, context_ids,
                                                      whole[len(context_ids):])
            worst = max(worst, abs(ours - ref))
            assert ours_greedy == ref_greedy
            scores.append(ref)
        correct += max(range(len(scores)), key=scores.__getitem__) == sample["target"]
    print(f"lm-eval multiple choice: max |loglikelihood - transformers'| = {worst:.2e}")
    assert worst <= LOGLIKELIHOOD_TOLERANCE
    acc = evaluation["results"]["llmserve_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(QUESTIONS))


def test_rolling_loglikelihood_equals_transformers(evaluation, tokenizer, reference_model):
    samples = evaluation["samples"]["llmserve_rolling"]
    assert len(samples) == len(TEXTS)
    # lm-eval's first window starts after one prefix token: the BOS, else the EOS
    prefix = tokenizer.bos_token_id or tokenizer.eos_token_id
    worst, total, words = 0.0, 0.0, 0
    for sample in samples:
        ours = sample["resps"][0][0]
        text = sample["doc"]["text"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        ref, _ = reference_loglikelihood(reference_model, [prefix], ids)
        worst = max(worst, abs(ours - ref))
        total += ref
        words += len(text.split())
    print(f"lm-eval rolling loglikelihood: max |diff| vs transformers = {worst:.2e}")
    assert worst <= LOGLIKELIHOOD_TOLERANCE
    perplexity = evaluation["results"]["llmserve_rolling"]["word_perplexity,none"]
    assert perplexity == pytest.approx(math.exp(-total / words), rel=1e-3)
