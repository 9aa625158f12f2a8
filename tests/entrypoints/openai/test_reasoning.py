"""Reasoning output: `--reasoning-parser` splits <think>...</think> into `reasoning_content`,
whole and streamed (the same split however the text is cut), `include_reasoning: false`
leaves it out, and a constraint waits for the end of the thinking (`starts_after`)."""

import json

import pytest
import torch

from llmserve.entrypoints.openai.reasoning import (
    ReasoningStream,
    answer_start,
    resolve_parser,
    split_reasoning,
)
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.structured.deferred import DeferredMatcher
from llmserve.structured.manager import StructuredOutputManager
from tests.entrypoints.openai.conftest import MODEL, run_server

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking: false
CASES = [  # (parser, prompt's end, output, reasoning, content)
    ("deepseek_r1", "assistant<think>\n", "Two plus two.</think>\n\nFour.", "Two plus two.",
     "Four."),
    ("deepseek_r1", "assistant", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "assistant", "cut by max_tokens", "cut by max_tokens", ""),
    ("qwen3", QWEN3_PROMPT, "<think>\nplan</think>\n\n{\"a\": 1}", "\nplan", "{\"a\": 1}"),
    ("qwen3", QWEN3_PROMPT, "no thinking at all", None, "no thinking at all"),
    ("qwen3", QWEN3_NO_THINKING, "an <think> inside", None, "an <think> inside"),
    ("qwen3", QWEN3_PROMPT, "<thi", None, "<thi"),
]


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_whole_and_streamed_splits_agree(parser, prompt, output, reasoning, content):
    start = answer_start(parser, prompt)
    assert split_reasoning(output, start) == (reasoning, content)
    for step in (1, 2, 3, 7):
        stream, got_reasoning, got_content = ReasoningStream(start), "", ""
        for i in range(0, len(output), step):
            r, c = stream.feed(output[i:i + step])
            got_reasoning, got_content = got_reasoning + r, got_content + c
        r, c = stream.finish()
        got = (got_reasoning + r if stream.saw_reasoning else None, got_content + c)
        assert got == (reasoning, content), step


FORCED = "<think>I count.</think>\n\nOne, two."


@pytest.fixture(scope="module")
def qwen3_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, reasoning_parser="qwen3") as running:
        yield running


def forced_chat(server, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 40, "structured_outputs": {"regex": FORCED.replace(".", r"\.")},
            **extra}
    response = server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_reasoning_content_whole_and_streamed(qwen3_server):
    message = forced_chat(qwen3_server)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("I count.", "One, two.")
    thought, text = "", ""
    with qwen3_server.http() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 40, "stream": True,
            "structured_outputs": {"regex": FORCED.replace(".", r"\.")}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    thought += choice["delta"].get("reasoning_content") or ""
                    text += choice["delta"].get("content") or ""
    assert (thought, text) == ("I count.", "One, two.")


def test_include_reasoning_false_leaves_the_thinking_out(qwen3_server, server):
    message = forced_chat(qwen3_server, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "One, two."
    # without a parser nothing is split, so leaving reasoning out cannot be honoured
    refused = server.http().post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "include_reasoning": False})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "include_reasoning"


def test_a_deferred_constraint_allows_anything_then_its_grammar(loaded_model):
    tokenizer = loaded_model.tokenizer
    manager = StructuredOutputManager(tokenizer, loaded_model.config.vocab_size)
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        starts_after="</think>")
    matcher = manager.matcher(params)
    assert isinstance(matcher, DeferredMatcher)
    words = (loaded_model.config.vocab_size + 31) // 32
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    thinking = tokenizer.encode("Let me think </think>", add_special_tokens=False)
    for token in thinking:
        matcher.fill_bitmask(bitmask, 0)
        assert (bitmask == -1).all()  # free while thinking
        assert matcher.accept_token(token)
    matcher.fill_bitmask(bitmask, 0)
    assert not (bitmask == -1).all()  # the schema now
    answer = tokenizer.encode('{"a": 1}', add_special_tokens=False)  # json.dumps' layout
    assert matcher.num_valid(answer) == len(answer)
    not_json = tokenizer.encode("Sure", add_special_tokens=False)
    assert matcher.num_valid(not_json) == 0
    # drafts may roll back across the start
    for token in answer:
        assert matcher.accept_token(token)
    assert matcher.is_terminated
    matcher.rollback(len(answer) + 1)
    assert not matcher.started and not matcher.is_terminated
    assert matcher.num_valid(thinking[-1:] + answer) == 1 + len(answer)


def test_the_engine_applies_the_constraint_after_the_marker(smollm2_llm):
    """End to end through the scheduler and sampler: greedy free text up to the first
    '.', then a JSON object the schema accepts."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=
                            StructuredOutputsParams(json=schema, starts_after="."))
    prompt = smollm2_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say a sentence, then a number."}], tokenize=True)
    (out,) = smollm2_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    text = out.outputs[0].text
    free, constrained = text.split(".", 1)
    assert free and out.outputs[0].finish_reason == "stop", text
    assert set(json.loads(constrained)) == {"n"}


# the reasoning parts of real templates (Qwen3's, DeepSeek-R1-Distill's), abridged
QWEN3_TEMPLATE = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
                  "{%- if '</think>' in content %}{%- set content = content.split('</think>')"
                  "[-1] %}{%- endif %}")
DEEPSEEK_R1_TEMPLATE = ("{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}"
                        "{% endif %}{% set content = content.split('</think>')[-1] %}")


@pytest.mark.parametrize(("template", "parser"), [
    (QWEN3_TEMPLATE, "qwen3"), (DEEPSEEK_R1_TEMPLATE, "deepseek_r1"), (None, None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None)])
def test_auto_picks_the_family_the_template_declares(template, parser):
    assert resolve_parser("auto", template) == parser
    assert resolve_parser("none", QWEN3_TEMPLATE) is None
    assert resolve_parser("deepseek_r1", None) == "deepseek_r1"


def test_auto_on_a_template_without_thinking_runs_no_parser(smollm2_gguf, loaded_model):
    assert "<think>" not in loaded_model.tokenizer.chat_template
    with run_server(smollm2_gguf, loaded_model, reasoning_parser="auto") as running:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4}
        with running.http() as http:
            answer = http.post("/v1/chat/completions", json=body).json()
            refused = http.post("/v1/chat/completions", json=body | {"include_reasoning": False})
    assert "reasoning_content" not in answer["choices"][0]["message"]
    assert refused.status_code == 400
