"""Regexes, choices, Lark and GBNF grammars and `json_object` on the real model with
sampling on: every complete output matches its constraint, streamed and not.

The grammars are checked by hand-written recognisers of the same languages (`lark` is not
a dependency), so a wrong mask cannot be hidden by a checker sharing its parser.
"""

import json
import re
from dataclasses import dataclass

import pytest

from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.structured.helpers import Streamed, chat_prompt, stream

SEEDS = (5, 6, 7)

REGEXES = {
    "us_phone": (r"\(\d{3}\) \d{3}-\d{4}", "What is the office's phone number?"),
    "iso_date": (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "When was the Moon landing?"),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
             "What is the router's IP address?"),
    "identifier": (r"[A-Za-z_][A-Za-z0-9_]{0,15}", "Name a Python variable for a user count."),
    "answer": (r"(yes|no|maybe)(, because [a-z ]{1,30})?", "Will it rain tomorrow?"),
    "email": (r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)", "Give me an email address."),
    "time_24h": (r"([01]\d|2[0-3]):[0-5]\d", "What time does the shop open?"),
}

CHOICES = {
    "sentiment": (["positive", "negative", "neutral"],
                  "Classify the sentiment of: 'I loved this film!'"),
    "capital": (["Paris", "London", "Berlin", "Madrid", "Rome"],
                "What is the capital of France?"),
    # one choice is a prefix of the others: ending after "New" must stay possible
    "prefixes": (["New York", "New Delhi", "Newcastle", "New"], "Name a city."),
    # multi-byte characters split over several byte-level tokens
    "emoji": (["👍", "👎", "🤷"], "React to this message: 'We won the match!'"),
}

ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: factor (("*" | "/") factor){0,2}
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""

ROBOT = r"""
start: command ("; " command){0,2}
command: move | turn | say
move: "move " DIRECTION " " STEPS
turn: "turn " ("left" | "right")
say: "say \"" WORD "\""
DIRECTION: "north" | "south" | "east" | "west"
STEPS: /[1-9][0-9]?/
WORD: /[a-z]{1,10}/
"""

CONFIG_GBNF = r"""
root ::= pair ("\n" pair){0,2}
pair ::= key "=" value
key ::= [a-z]{1,8}
value ::= [0-9]{1,4} | "\"" [a-zA-Z ]{0,12} "\""
"""


def is_arithmetic(text: str) -> bool:
    """A recursive-descent recogniser of ARITHMETIC."""

    def expr(i: int) -> int | None:
        i = term(i)
        for _ in range(3):
            if i is None or i >= len(text) or text[i] not in "+-":
                return i
            i = term(i + 1)
        return i

    def term(i: int) -> int | None:
        i = factor(i)
        for _ in range(2):
            if i is None or i >= len(text) or text[i] not in "*/":
                return i
            i = factor(i + 1)
        return i

    def factor(i: int) -> int | None:
        if text[i:i + 1] == "(":
            i = expr(i + 1)
            return i + 1 if i is not None and text[i:i + 1] == ")" else None
        number = re.match(r"[0-9]{1,4}", text[i:])
        return i + number.end() if number else None

    return expr(0) == len(text)


def is_robot_program(text: str) -> bool:
    commands = text.split("; ")
    command = re.compile(r'move (north|south|east|west) [1-9][0-9]?|turn (left|right)'
                         r'|say "[a-z]{1,10}"')
    return 1 <= len(commands) <= 3 and all(command.fullmatch(c) for c in commands)


def is_config(text: str) -> bool:
    lines = text.split("\n")
    pair = re.compile(r'[a-z]{1,8}=([0-9]{1,4}|"[a-zA-Z ]{0,12}")')
    return 1 <= len(lines) <= 3 and all(pair.fullmatch(line) for line in lines)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


@dataclass(frozen=True)
class Case:
    name: str
    request: str
    constraint: StructuredOutputsParams
    accepts: object  # (text) -> bool
    bounded: bool = True  # every complete match fits in MAX_TOKENS


CASES = [
    *(Case(f"regex_{name}", request, StructuredOutputsParams(regex=regex),
           lambda text, regex=regex: re.fullmatch(regex, text, re.ASCII) is not None)
      for name, (regex, request) in REGEXES.items()),
    *(Case(f"choice_{name}", request, StructuredOutputsParams(choice=choices),
           lambda text, choices=choices: text in choices)
      for name, (choices, request) in CHOICES.items()),
    # parentheses nest without bound
    Case("lark_arithmetic", "Write an arithmetic expression that equals 42.",
         StructuredOutputsParams(grammar=ARITHMETIC), is_arithmetic, bounded=False),
    Case("lark_robot", "Tell the robot how to reach the kitchen.",
         StructuredOutputsParams(grammar=ROBOT), is_robot_program),
    Case("gbnf_config", "Write a small configuration file for a web server.",
         StructuredOutputsParams(grammar=CONFIG_GBNF), is_config),
    Case("json_object", "Describe your favourite animal as a JSON object.",
         StructuredOutputsParams(json_object=True), is_json_object, bounded=False),
]
# two seeds a case by default (sampling varies), all three under -m slow
TIERS = {"2 seeds": [(case, seed) for case in CASES for seed in SEEDS[:2]],
         "3 seeds": [(case, seed) for case in CASES for seed in SEEDS]}
MAX_TOKENS = 200


def params(case: Case, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                          structured_outputs=case.constraint)


@pytest.fixture(scope="module", params=["2 seeds", pytest.param("3 seeds",
                                                                 marks=pytest.mark.slow)])
def runs(request) -> list[tuple[Case, int]]:
    return TIERS[request.param]


@pytest.fixture(scope="module")
def prompts(structured_llm, runs) -> list[dict]:
    return [chat_prompt(structured_llm.tokenizer, case.request) for case, _ in runs]


@pytest.fixture(scope="module")
def final(structured_llm, runs, prompts) -> list[CompletionOutput]:
    outputs = structured_llm.generate(prompts, [params(*run) for run in runs], use_tqdm=False)
    return [output.outputs[0] for output in outputs]


@pytest.fixture(scope="module")
def streamed(structured_engine, runs, prompts, final) -> list[Streamed]:
    return stream(structured_engine, prompts, [params(*run) for run in runs])


def outputs_of(case: Case, runs: list, outputs: list) -> list:
    return [out for (c, _), out in zip(runs, outputs, strict=True) if c is case]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_outputs_match_the_constraint(case, runs, final, streamed):
    for whole, joined in zip(outputs_of(case, runs, final), outputs_of(case, runs, streamed),
                             strict=True):
        assert (joined.text, joined.token_ids) == (whole.text, whole.token_ids)
        assert joined.finish_reason == whole.finish_reason
        if whole.finish_reason == "stop":
            assert case.accepts(whole.text), whole.text
        else:
            assert not case.bounded and whole.finish_reason == "length", whole


def test_the_checkers_tell_matches_from_near_misses():
    """The hand-written recognisers reject what the grammars reject."""
    assert is_arithmetic("12+(3*4)/5") and is_arithmetic("((7))")
    assert not any(map(is_arithmetic, ["", "1+", "(1", "12345", "1+2+3+4+5", "1 + 2"]))
    assert is_robot_program('move north 3; turn left; say "hi"')
    assert not any(map(is_robot_program, ["move up 3", "turn left;turn right", "say hi",
                                          "turn left; turn left; turn left; turn left"]))
    assert is_config('port=8080\nname="web"') and is_config('x=""')
    assert not any(map(is_config, ["port=12345", "Port=1", "a=1\n", "a=1\nb=2\nc=3\nd=4"]))


def test_sampling_varies_the_answers(runs, final):
    varied = [case.name for case in CASES
              if len({o.text for o in outputs_of(case, runs, final)}) > 1]
    assert len(varied) >= len(CASES) // 2, varied
