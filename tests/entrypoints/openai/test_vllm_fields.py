"""Every request field vLLM defines is honoured or refused by name, never dropped.

The field lists are vLLM's `CompletionRequest` and `ChatCompletionRequest` (its OpenAI
server's request models, as its API reference documents them), written in here. Each field
is sent with a value that asks for something; the answer is a 200 or a 400 naming it. The
fields llmserve honours newly are then checked for their effect, one test each.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.entrypoints.openai.tool_parsers import FirstCallOnly, TaggedCallExtractor
from llmserve.sampling_params import SamplingParams
from tests.entrypoints.openai.conftest import MODEL

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# vLLM's fields shared by both routes, each with a value that asks for something
SHARED = {
    "model": MODEL, "n": 2, "best_of": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "logit_bias": {"5": 1.0}, "seed": 7, "stop": ["\n\n"], "stream": False,
    "stream_options": None, "temperature": 0.5, "top_p": 0.9, "user": "someone",
    "use_beam_search": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
    "length_penalty": 2.0, "stop_token_ids": [2], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8,
    "allowed_token_ids": [5, 6, 7], "prompt_logprobs": 1, "bad_words": ["Paris"],
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["yes", "no"]}, "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "yes" | "no"', "guided_decoding_backend": "llguidance",
    "guided_whitespace_pattern": " ", "priority": 1, "request_id": None,
    "logits_processors": ["my_module.MyProcessor"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "salt", "kv_transfer_params": {"x": 1},
    "vllm_xargs": {"a": 1}, "add_special_tokens": True, "prompt_embeds": "AAAA",
}
COMPLETION_ONLY = {"prompt": "The capital of France is", "echo": True, "logprobs": 2,
                   "max_tokens": 3, "suffix": "!"}
CHAT_ONLY = {
    "messages": [{"role": "user", "content": "Say hi."}], "logprobs": True, "top_logprobs": 2,
    "max_tokens": 3, "max_completion_tokens": 3, "tools": [TOOL], "tool_choice": "auto",
    "reasoning_effort": "low", "include_reasoning": False, "parallel_tool_calls": False,
    "echo": True, "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"x": 1}, "mm_processor_kwargs": {"a": 1},
    "structural_tag": "{}", "functions": [TOOL["function"]], "function_call": "auto",
}
# where a field's value needs another one to mean anything (a 400 would name that one)
PAIRED = {"continue_final_message": {"add_generation_prompt": False,
                                     "messages": [{"role": "user", "content": "Hi"},
                                                  {"role": "assistant", "content": "Hello"}]},
          "best_of": {"n": 1}, "top_logprobs": {"logprobs": True}}


def post(server, route: str, body: dict) -> httpx.Response:
    return server.http().post(f"/v1/{route}", json=body)


def answer(server, route: str, field: str) -> str | None:
    """What is wrong with the server's answer to `field` set on `route` (None: honoured
    with a 200, or refused with a 400 naming it)."""
    base = ({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}
            if route == "completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
             "max_tokens": 2})
    value = {**SHARED, **COMPLETION_ONLY, **CHAT_ONLY}[field]
    if field == "request_id":
        value = f"walk-{route.replace('/', '-')}"
    body = {**base, **PAIRED.get(field, {}), field: value}
    response = post(server, route, body)
    if response.status_code == 200:
        return None
    if response.status_code != 400:
        return f"{response.status_code}: {response.text[:200]}"
    error = response.json()["error"]
    if error["param"] != field and not (error["param"] or "").startswith(f"{field}."):
        return f"the 400 names {error['param']!r}: {error['message']}"
    return None


@pytest.mark.parametrize("route,fields", [
    ("completions", {**SHARED, **COMPLETION_ONLY}), ("chat/completions", {**SHARED, **CHAT_ONLY})])
def test_each_vllm_field_is_honoured_or_refused_by_name(server, route, fields):
    """All at once (the engine batches them); the request's own fields (model, prompt,
    messages, stream) are sent by every other test."""
    walked = [f for f in fields if f not in ("model", "stream", "stream_options", "prompt",
                                             "messages")]
    with ThreadPoolExecutor(16) as pool:
        problems = dict(zip(walked, pool.map(lambda f: answer(server, route, f), walked),
                            strict=True))
    assert not {f: p for f, p in problems.items() if p}


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(server):
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/completions", timeout=120, json={
            "model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1


def test_token_ids_and_tokens_as_ids(server, tokenizer):
    body = post(server, "completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, "logprobs": 1, "return_token_ids": True,
        "return_tokens_as_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("The capital of France is")
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = post(server, "chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0, "return_token_ids": True}).json()
    assert tokenizer.decode(chat["choices"][0]["token_ids"], skip_special_tokens=True) == \
        chat["choices"][0]["message"]["content"]
    assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    # streamed: the same ids, the prompt's in the first chunk
    streamed, prompt_ids = [], None
    with httpx.stream("POST", f"{server.base_url}/completions", timeout=120, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "stream": True, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    prompt_ids = prompt_ids or c.get("prompt_token_ids")
                    streamed += c["token_ids"]
    assert (prompt_ids, streamed) == (choice["prompt_token_ids"], choice["token_ids"])


def test_request_id_names_the_response(server):
    body = post(server, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                        "request_id": "my-job-17"}).json()
    assert body["id"] == "cmpl-my-job-17"
    chat = post(server, "chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "request_id": "my-job-18"}).json()
    assert chat["id"] == "chatcmpl-my-job-18"


def test_continue_final_message_continues_the_assistant_text(server, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    body = post(server, "chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
        "add_generation_prompt": False, "continue_final_message": True,
        "return_token_ids": True}).json()
    prompt = tokenizer.decode(body["prompt_token_ids"])
    assert prompt.endswith("My favourite colour is"), prompt[-60:]
    closed = post(server, "chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3,
        "add_generation_prompt": False, "return_token_ids": True}).json()
    assert len(closed["prompt_token_ids"]) > len(body["prompt_token_ids"])  # end of turn
    refused = post(server, "chat/completions", {"model": MODEL, "messages": messages,
                                                 "continue_final_message": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_starts_the_answer_with_the_assistant_prefix(server):
    messages = [{"role": "user", "content": "Count."},
                {"role": "assistant", "content": "One, two,"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = post(server, "chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "One, two," + plain
    text = ""
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=120,
                      json={**body, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == "One, two," + plain
    # the last message is the user's: nothing to echo
    user_last = post(server, "chat/completions", {
        "model": MODEL, "messages": messages[:1], "max_tokens": 4, "temperature": 0,
        "echo": True}).json()
    alone = post(server, "chat/completions", {
        "model": MODEL, "messages": messages[:1], "max_tokens": 4, "temperature": 0}).json()
    assert user_last["choices"][0]["message"] == alone["choices"][0]["message"]


def test_truncate_prompt_tokens_keeps_the_prompt_end(server, tokenizer):
    ids = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve")
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    cut = post(server, "completions", {**body, "prompt": ids, "truncate_prompt_tokens": 5})
    assert cut.status_code == 200, cut.text
    tail = post(server, "completions", {**body, "prompt": ids[-5:]}).json()
    assert cut.json()["usage"]["prompt_tokens"] == 5
    assert cut.json()["choices"][0]["text"] == tail["choices"][0]["text"]


def test_parallel_tool_calls_false_keeps_the_first_call_the_model_makes():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    extractor = FirstCallOnly(TaggedCallExtractor())
    pieces = []
    for i in range(0, len(text), 7):  # fed as a stream would feed it
        pieces += extractor.feed(text[i:i + 7]).tool_calls
    pieces += extractor.finish().tool_calls
    assert {p.index for p in pieces} == {0}
    assert [p.name for p in pieces if p.name] == ["a"]
    assert extractor.num_calls == 1


def test_sampling_params_take_vllm_fields(smollm2_llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False,
                            spaces_between_special_tokens=False)
    (out,) = smollm2_llm.generate("The capital of France is", params, use_tqdm=False)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
    ids = smollm2_llm.tokenizer.encode("one two three four five six seven eight nine")
    cut = SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=4)
    (short,) = smollm2_llm.generate({"prompt_token_ids": ids}, cut, use_tqdm=False)
    (tail,) = smollm2_llm.generate({"prompt_token_ids": ids[-4:]},
                                   SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert short.prompt_token_ids == ids[-4:]
    assert short.outputs[0].token_ids == tail.outputs[0].token_ids
    for name, value in (("logits_processors", [lambda ids, logits: logits]),
                        ("extra_args", {"a": 1}), ("truncate_prompt_tokens", 0)):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
