"""JSON schemas on the real model with sampling on: every complete output is valid JSON the
schema accepts (Draft 2020-12, formats checked), streamed and not.

All schemas x seeds run as one batch through `LLM.generate` (final outputs), then the
first seed's runs (compact and flexible) again as a batch of their own through
`Engine.step` with `output_kind=DELTA`: the joined deltas must be valid too and equal, token
for token, to the final output of the same seed (a seeded request's tokens do not depend on
the batch it runs in). The default tier streams every third schema and the flexible ones,
the slow tier every schema.
"""

import json
import re
from dataclasses import dataclass

import pytest

from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.structured.helpers import Streamed, chat_prompt, json_violation, stream
from tests.structured.schemas import SCHEMAS, SchemaCase, validator

SEEDS = (11, 22, 33)
TEMPERATURE = 0.9
MAX_TOKENS = 320  # the longest output seen is 172 tokens (a recipe)
# also run with any whitespace allowed between JSON tokens (one seed each)
FLEXIBLE = ("order", "matrix", "recipe", "profile", "user_row")


@dataclass(frozen=True)
class Run:
    case: SchemaCase
    seed: int
    whitespace_flexible: bool = False

    def params(self) -> SamplingParams:
        constraint = StructuredOutputsParams(json=self.case.schema,
                                             whitespace_flexible=self.whitespace_flexible)
        return SamplingParams(temperature=TEMPERATURE, seed=self.seed, max_tokens=MAX_TOKENS,
                              structured_outputs=constraint)




def runs_with(seeds: tuple[int, ...], every: int = 1) -> list[Run]:
    """Each schema with the first seed, every `every`-th one with all `seeds` (its runs
    side by side), and the FLEXIBLE ones once more with flexible whitespace."""
    return [Run(case, seed) for i, case in enumerate(SCHEMAS)
            for seed in (seeds if i % every == 0 else seeds[:1])] + [
        Run(case, seeds[0], whitespace_flexible=True) for case in SCHEMAS
        if case.name in FLEXIBLE]


# by default every other schema with two seeds (enough to see sampling vary), the rest with
# one; every schema with all three in the slow tier
TIERS = {"2 seeds": runs_with(SEEDS[:2], every=2), "3 seeds": runs_with(SEEDS)}
REQUIRED_KEYWORDS = {
    "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const",
    "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "$defs"}


@pytest.fixture(scope="module", params=["2 seeds", pytest.param("3 seeds",
                                                                 marks=pytest.mark.slow)])
def runs(request) -> list[Run]:
    return TIERS[request.param]


@pytest.fixture(scope="module")
def prompts(structured_llm, runs) -> list[dict]:
    return [chat_prompt(structured_llm.tokenizer, f"{run.case.request} Answer in JSON.")
            for run in runs]


@pytest.fixture(scope="module")
def final(structured_llm, runs, prompts) -> list[CompletionOutput]:
    outputs = structured_llm.generate(prompts, [run.params() for run in runs], use_tqdm=False)
    return [output.outputs[0] for output in outputs]


STREAMED = {case.name for i, case in enumerate(SCHEMAS) if i % 3 == 0 or case.name in FLEXIBLE}


def streamed_param(case: SchemaCase):
    return case if case.name in STREAMED else pytest.param(case, marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def streamed(request, structured_engine, runs, prompts, final) -> dict[int, Streamed]:
    """The first seed's runs of the cases whose streamed test this session runs (at this
    tier), streamed, by their index in `runs`."""
    cases = {item.callspec.params["case"].name for item in request.session.items
             if item.module is request.module and item.originalname ==
             "test_streamed_outputs_match_the_schema_and_the_final_text"
             and TIERS[item.callspec.params["runs"]] is runs}
    picked = [i for i, run in enumerate(runs) if run.seed == SEEDS[0] and run.case.name in cases]
    joined = stream(structured_engine, [prompts[i] for i in picked],
                    [runs[i].params() for i in picked])
    return dict(zip(picked, joined, strict=True))


def problems(case: SchemaCase, runs: list[Run],
             outputs: list[tuple[str, str | None]]) -> list[str]:
    """What is wrong with a case's (text, finish_reason) outputs, in `runs_of` order: a
    complete output the schema rejects, or a bounded schema's compact output cut by
    max_tokens. (With flexible whitespace no schema bounds the length: any run of
    whitespace may sit between two JSON tokens; nor do JSON numbers: any number of digits.)"""
    check = validator(case.schema)
    found = []
    for run, (text, finish_reason) in zip(runs_of(case, runs, runs), outputs, strict=True):
        if finish_reason == "stop":
            violation = json_violation(check, text)
            if violation:
                found.append(f"{violation}: {text!r}")
        elif finish_reason != "length" or (case.length_bounded and not run.whitespace_flexible):
            found.append(f"finish_reason {finish_reason}: {text!r}")
    return found


def runs_of(case: SchemaCase, runs: list[Run], outputs: list) -> list:
    return [out for run, out in zip(runs, outputs, strict=True) if run.case is case]


def keywords(schema: object) -> set[str]:
    if isinstance(schema, dict):
        return set(schema).union(*map(keywords, schema.values()))
    if isinstance(schema, list):
        return set().union(*map(keywords, schema))
    return set()


def test_the_schemas_cover_the_json_schema_features():
    assert len(SCHEMAS) >= 30
    assert len({case.name for case in SCHEMAS}) == len(SCHEMAS)
    used = set().union(*(keywords(case.schema) for case in SCHEMAS))
    assert REQUIRED_KEYWORDS <= used, REQUIRED_KEYWORDS - used
    formats = {"date", "time", "date-time", "email", "ipv4", "ipv6", "uuid"}
    assert formats <= {value for case in SCHEMAS for value in _values_of(case.schema, "format")}


def _values_of(schema: object, key: str) -> list:
    if isinstance(schema, dict):
        found = [schema[key]] if isinstance(schema.get(key), str) else []
        return found + [v for value in schema.values() for v in _values_of(value, key)]
    if isinstance(schema, list):
        return [v for value in schema for v in _values_of(value, key)]
    return []


@pytest.mark.parametrize("case", SCHEMAS, ids=lambda case: case.name)
def test_final_outputs_match_the_schema(case, runs, final):
    outputs = [(out.text, out.finish_reason) for out in runs_of(case, runs, final)]
    assert not problems(case, runs, outputs)


@pytest.mark.parametrize("case", [streamed_param(c) for c in SCHEMAS], ids=lambda c: c.name)
def test_streamed_outputs_match_the_schema_and_the_final_text(case, runs, final, streamed):
    picked = [i for i in streamed if runs[i].case is case]
    assert picked
    joined = [streamed[i] for i in picked]
    assert not problems(case, [runs[i] for i in picked],
                        [(s.text, s.finish_reason) for s in joined])
    for whole, deltas in zip([final[i] for i in picked], joined, strict=True):
        assert (deltas.text, deltas.token_ids) == (whole.text, whole.token_ids)
        assert deltas.finish_reason == whole.finish_reason
        assert deltas.num_deltas == len(whole.token_ids)  # one delta per sampled token


def test_sampling_is_on(runs, final):
    """The seeds give different objects for most schemas: the constraint, not a greedy
    argmax, is what keeps them valid."""
    seeded = [case for case in SCHEMAS
              if len({run.seed for run in runs_of(case, runs, runs)}) > 1]
    varied = [case.name for case in seeded
              if len({out.text for out in runs_of(case, runs, final)}) > 1]
    assert len(seeded) >= len(SCHEMAS) // 2
    assert len(varied) >= len(seeded) * 2 // 3, varied


def test_compact_and_flexible_whitespace(runs, final):
    """Compact outputs are laid out as `json.dumps` writes them (", " and ": ", nothing
    else between tokens); flexible ones (newlines and indents seen) are only validated."""
    for run, out in zip(runs, final, strict=True):
        if run.whitespace_flexible or out.finish_reason != "stop":
            continue
        value = json.loads(out.text)
        assert "\n" not in out.text
        assert _without_strings(out.text) == _without_strings(
            json.dumps(value, ensure_ascii=False)), out.text


def _without_strings(text: str) -> str:
    """The JSON text's structure: strings and numbers replaced (numbers are written as the
    model chose, e.g. 10.50)."""
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"-?[0-9][0-9.eE+-]*", "0", text)


def test_summary(runs, final, streamed):
    """The acceptance count: every complete output, final and streamed, is valid."""
    outputs = [(run, out.text, out.finish_reason) for run, out in zip(runs, final, strict=True)]
    outputs += [(runs[i], s.text, s.finish_reason) for i, s in streamed.items()]
    complete = [(run.case, text) for run, text, reason in outputs if reason == "stop"]
    valid = sum(json_violation(validator(case.schema), text) is None
                for case, text in complete)
    by_length = [run.case.name for run, _, reason in outputs if reason == "length"]
    print(f"\nstructured outputs: {len(SCHEMAS)} schemas, {len(outputs)} outputs "
          f"({len(runs)} final + {len(streamed)} streamed), {len(complete)} complete, "
          f"{valid} valid ({100 * valid / max(len(complete), 1):.1f} %), "
          f"{len(by_length)} ended by length {sorted(set(by_length))}")
    assert valid == len(complete)
    assert all(not run.case.length_bounded or run.whitespace_flexible
               for run, _, reason in outputs if reason == "length")
