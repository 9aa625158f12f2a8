"""The contract fuzzer's structured-output corner: constraints drawn large and pathological
(nested repeats, wide alternations, choice lists around the cap, huge enums, deep schemas,
Lark text) on the chat and completions routes. Every answer is a 200 whose text keeps the
constraint (checked where Python can: a choice, a regex), or a 4xx in OpenAI's shape
naming the field that set it; never a 5xx, never a hang, and the server still serves.

The default suite draws FUZZ_EXAMPLES cases; `-m slow` draws SLOW_EXAMPLES."""

import re
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.sampling_params import MAX_CONSTRAINT_CHOICES
from tests.entrypoints.openai.conftest import run_server, wait_engine_idle

FUZZ_EXAMPLES, SLOW_EXAMPLES = 20, 300
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ATOMS = ["a", "b", "[a-z]", "\\d", ".", "(a|b)", "x{3}", "[^a]", " "]


@st.composite
def regexes(draw, depth: int = 0) -> str:
    """Regexes built from a few atoms by concatenation, alternation and (nested) repeats:
    the shapes that blow up lexers (`((a{100}){100}){100}`)."""
    if depth > 2 or draw(st.booleans()):
        return draw(st.sampled_from(ATOMS))
    inner = draw(regexes(depth + 1))
    kind = draw(st.sampled_from(["repeat", "star", "alt", "cat"]))
    if kind == "repeat":
        low = draw(st.integers(0, 120))
        return f"({inner}){{{low},{low + draw(st.integers(0, 120))}}}"
    if kind == "star":
        return f"({inner})*"
    other = draw(regexes(depth + 1))
    return f"({inner}|{other})" if kind == "alt" else inner + other


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
CONSTRAINTS = st.one_of(
    regexes().map(lambda r: ("structured_outputs", {"regex": r})),
    st.integers(1, MAX_CONSTRAINT_CHOICES + 5).flatmap(
        lambda n: st.lists(TEXT, min_size=min(n, 3), max_size=min(n, 3)).map(
            lambda head, n=n: ("structured_outputs",
                               {"choice": head + [f"c{i}" for i in range(n - len(head))]}))),
    st.integers(1, 3 * MAX_CONSTRAINT_CHOICES).map(lambda n: ("response_format", {
        "type": "json_schema", "json_schema": {"name": "e", "schema": {
            "type": "string", "enum": [f"v{i}" for i in range(n)]}}})),
    st.integers(1, 60).map(lambda depth: ("response_format", {
        "type": "json_schema", "json_schema": {"name": "d", "schema": _nested(depth)}})),
    st.text(string.printable, max_size=80).map(
        lambda text: ("structured_outputs", {"grammar": f"start: {text}"})),
    st.sampled_from(["((a{100}){100}){100}", "(a*)*b", "(a|a)*c{1000}", "[", "a{99999}"]).map(
        lambda r: ("structured_outputs", {"regex": r})),
)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"k": schema}, "required": ["k"]}
    return schema


@pytest.fixture(scope="module")
def server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, grammar_timeout=5.0) as running:
        yield running


def _check(server, field: str, constraint: dict, route: str) -> None:
    body = {"max_tokens": 6, "temperature": 0, field: constraint}
    body.update({"messages": [{"role": "user", "content": "Go."}]} if route == CHAT
                else {"prompt": "Go."})
    with httpx.Client(base_url=server.url, timeout=120) as http:
        reply = http.post(route, json=body)
    assert reply.status_code < 500, (constraint, reply.text)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["param"] and error["param"].split(".")[0] == field, (constraint, error)
        assert error["type"] == "invalid_request_error", error
        return
    choice = reply.json()["choices"][0]
    text = choice["message"]["content"] if route == CHAT else choice["text"]
    if "choice" in constraint and choice["finish_reason"] == "stop":
        assert text in constraint["choice"], (text, constraint)
    if "regex" in constraint:
        try:
            pattern = re.compile(constraint["regex"])
        except re.error:
            return
        # a prefix of a match (cut by max_tokens) or a whole one
        assert choice["finish_reason"] == "length" or pattern.fullmatch(text), (text, constraint)


def _fuzz(server, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(CONSTRAINTS, st.sampled_from([CHAT, COMPLETIONS]))
    def case(drawn, route):
        field, constraint = drawn
        _check(server, field, constraint, route)

    case()
    wait_engine_idle(server)
    assert server.engine.engine.kv_manager.usage == 0
    with httpx.Client(base_url=server.url, timeout=60) as http:  # still serving
        assert http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_fuzzed_constraints_get_a_kept_answer_or_a_4xx(server):
    _fuzz(server, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_fuzzed_constraints_many_more(server):
    _fuzz(server, SLOW_EXAMPLES)

