"""Scoring over /v1/completions: `echo` with `logprobs` (OpenAI's legacy shape over prompt and
completion) and `max_tokens: 0` (the prompt alone), whole and streamed, on the exact float32
server; the prompt's log-probabilities equal transformers' on the same weights."""

import httpx
import pytest
import torch

from tests.entrypoints.openai.conftest import MODEL

PROMPT = "The capital of France is Paris. The capital of Italy is"
SECOND = "Water boils at one hundred degrees"
LOGPROB_TOLERANCE = 1e-4  # the float32 path against transformers (the reference tests' bound)


def completions(server, **body) -> dict:
    response = server.http().post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, **body) -> list[dict]:
    """The chunks' choices of a streamed completion, in order."""
    choices = []
    with httpx.stream("POST", f"{server.base_url}/completions", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += httpx.Response(200, content=line[6:]).json()["choices"]
    return choices


def joined(choices: list[dict], index: int = 0) -> dict:
    """One choice's text and logprobs lists, its chunks joined."""
    out = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
           "text_offset": []}
    for c in choices:
        if c["index"] != index:
            continue
        out["text"] += c["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            out[key] += c["logprobs"][key]
        out["finish_reason"] = c["finish_reason"] or out.get("finish_reason")
    return out


def reference_logprobs(reference_model, ids: list[int]) -> list[float]:
    """transformers' log-probability of each token after the first, given those before."""
    with torch.inference_mode():
        logits = reference_model(torch.tensor([ids])).logits[0].float()
    picked = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    return picked[:, 0].tolist()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def test_max_tokens_0_scores_the_prompt_as_transformers_does(server, prompt_ids,
                                                            reference_model):
    body = completions(server, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt_ids), 0)
    assert len(logprobs["tokens"]) == len(prompt_ids)
    assert "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = reference_logprobs(reference_model, prompt_ids)
    diff = max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:], expected,
                                          strict=True))
    print(f"prompt logprobs: max |diff| vs transformers over {len(expected)} tokens "
          f"= {diff:.2e}")
    assert diff <= LOGPROB_TOLERANCE
    # text offsets: each token's first character in the returned text
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i]))
                                       for i in range(len(prompt_ids))]
    assert choice["prompt_logprobs"] is None  # vLLM's field only when asked for


def test_top_logprobs_hold_the_best_alternatives_and_the_prompt_token(server, prompt_ids):
    body = completions(server, prompt=PROMPT, echo=True, max_tokens=0, logprobs=3)
    logprobs = body["choices"][0]["logprobs"]
    for token, logprob, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:],
                                   logprobs["top_logprobs"][1:], strict=True):
        assert token in top and top[token] == logprob
        assert 3 <= len(top) <= 4  # the 3 best, and the prompt token when it is not one
        assert max(top.values()) >= logprob


def test_echo_with_completion_continues_the_prompt_logprobs(server, prompt_ids):
    scored = completions(server, prompt=PROMPT, echo=True, max_tokens=4, logprobs=2,
                         temperature=0)
    plain = completions(server, prompt=PROMPT, max_tokens=4, logprobs=2, temperature=0)
    echo, alone = scored["choices"][0], plain["choices"][0]
    n = len(prompt_ids)
    assert echo["text"] == PROMPT + alone["text"]
    assert len(echo["logprobs"]["tokens"]) == n + 4
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert echo["logprobs"][key][n:] == alone["logprobs"][key]
    assert echo["logprobs"]["text_offset"][n:] == [len(PROMPT) + offset for offset in
                                                   alone["logprobs"]["text_offset"]]
    assert scored["usage"]["completion_tokens"] == 4


def test_streamed_scores_equal_the_whole_response(server):
    for max_tokens in (0, 3):
        body = dict(prompt=PROMPT, echo=True, max_tokens=max_tokens, logprobs=2,
                    temperature=0)
        whole = completions(server, **body)["choices"][0]
        stream = joined(streamed(server, **body))
        assert stream["text"] == whole["text"]
        assert stream["finish_reason"] == whole["finish_reason"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert stream[key] == whole["logprobs"][key], key


def test_each_prompt_of_a_batch_is_scored_on_its_own(server, tokenizer):
    body = completions(server, prompt=[PROMPT, SECOND], echo=True, max_tokens=0, logprobs=0)
    by_index = {c["index"]: c for c in body["choices"]}
    for i, text in enumerate((PROMPT, SECOND)):
        single = completions(server, prompt=text, echo=True, max_tokens=0, logprobs=0)
        assert by_index[i]["text"] == text
        assert by_index[i]["logprobs"] == single["choices"][0]["logprobs"]
        assert len(by_index[i]["logprobs"]["tokens"]) == len(tokenizer.encode(text))


def test_token_id_prompts_are_scored(server, prompt_ids):
    by_ids = completions(server, prompt=prompt_ids, echo=True, max_tokens=0, logprobs=1)
    by_text = completions(server, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    assert by_ids["choices"][0]["logprobs"] == by_text["choices"][0]["logprobs"]


def test_max_tokens_0_without_echo_is_refused(server):
    response = server.http().post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                           "max_tokens": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"]


def test_the_openai_sdk_reads_the_scores(server):
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0,
                                      logprobs=1)
    logprobs = resp.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert resp.choices[0].text == PROMPT
