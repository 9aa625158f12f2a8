"""Speculative decoding in the engine, on the real default model.

Greedy output must be the non-speculative engine's, token for token, whatever proposes
the drafts and whatever else the engine does meanwhile (batching with requests that do not
speculate, chunked prefill, preemption, the prefix cache, stop conditions inside a run of
accepted drafts, logprobs, a grammar). Each test also checks that drafts were verified and
accepted, so that none of this can pass with speculation silently off.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from jsonschema import Draft202012Validator

from llmserve import LLM, SamplingParams
from llmserve.bench.quality import quality_text
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.loader.model_loader import LoadedModel
from llmserve.memory import kv_bytes_per_token
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.tokenizer import Tokenizer

MAX_TOKENS = 32  # about 8 rounds of 4 drafts a request
NUM_SPECULATIVE_TOKENS = 4
METHODS = ["ngram", "self_draft", "draft_model"]

CODE = '''\
def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    centre = mean(values)
    total = 0
    for value in values:
        total += (value - centre) ** 2
    return total / len(values)
'''

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 2,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20},
                               "age": {"type": "integer"},
                               "city": {"type": "string", "maxLength": 20}},
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}


# ---- engines -------------------------------------------------------------------------------


def spec_config(method: str, gguf: Path, **options) -> dict:
    """Drafts in every round (no adaptive k) and at any batch size."""
    config = {"method": method, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
              "adaptive": False, "disable_by_batch_size": None}
    if method == "draft_model":
        config["model"] = str(gguf)  # the target's own checkpoint as the draft
    return config | options


def build(gguf: Path, loaded: LoadedModel, speculative_config: dict | None = None,
          **options) -> LLM:
    """An engine on already loaded weights; float32 with a 256 MiB cache unless told."""
    options = {"dtype": "float32", "kv_cache_memory": "256MiB"} | options
    config = EngineConfig(model=str(gguf), speculative_config=speculative_config, **options)
    return LLM.from_engine(Engine(config, loaded=loaded))


@pytest.fixture(scope="module")
def float32_weights(smollm2_llm) -> LoadedModel:
    """The default model's exact float32 weights, loaded once for every engine here."""
    return smollm2_llm.engine.loaded


@pytest.fixture(scope="module")
def plain(smollm2_gguf, float32_weights) -> LLM:
    """The exact float32 engine without speculation: what every greedy output must equal."""
    return build(smollm2_gguf, float32_weights)


@pytest.fixture(scope="module")
def speculating(smollm2_gguf, float32_weights):
    """The same engine with each method's drafts, built on first use."""
    engines: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        if method not in engines:
            engines[method] = build(smollm2_gguf, float32_weights,
                                    spec_config(method, smollm2_gguf))
        return engines[method]

    return get


# ---- prompts -------------------------------------------------------------------------------


def paragraphs() -> list[str]:
    return [p.strip() for p in quality_text().split("\n\n") if len(p.split()) > 60]


def chat(tokenizer: Tokenizer, *turns: str, system: str | None = None) -> dict:
    """A conversation (user, assistant, user, ...) rendered with the chat template."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                 for i, text in enumerate(turns)]
    return {"prompt_token_ids": tokenizer.apply_chat_template(messages, tokenize=True)}


def mixed_prompts(tokenizer: Tokenizer) -> list:
    """Input-grounded prompts (prompt lookup finds their n-grams), lists, code, open-ended
    chat and plain completions."""
    text = paragraphs()
    return [
        chat(tokenizer, f"Repeat the following text exactly.\n\n{text[0]}"),
        chat(tokenizer, "Rewrite the following passage, replacing the word \"the\" with "
                        f"\"a\" and changing nothing else.\n\n{text[2]}"),
        chat(tokenizer, "Add a docstring to every function of this code and return the "
                        f"whole code.\n\n```python\n{CODE}```"),
        chat(tokenizer, "List the days of the week, one per line, then list them again in "
                        "reverse order."),
        chat(tokenizer, "What is the capital of France?"),
        chat(tokenizer, "Write a short story about a lighthouse keeper who finds a message "
                        "in a bottle."),
        chat(tokenizer, "Give me three tips for learning a language.",
             "1. Practise every day. 2. Read books you enjoy. 3. Speak with native speakers.",
             "Now repeat the tips, each with one more sentence of explanation.",
             system="You are a concise assistant."),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "1, 2, 3, 4, 5, 6, 7, 8,",
    ]


def grounded_prompts(tokenizer: Tokenizer) -> list:
    """The mixed prompts whose answers copy from their input: quote, edit, document."""
    return mixed_prompts(tokenizer)[:3]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# requests that never carry drafts: one token only (no room for any), and beam search
BYSTANDER_PROMPTS = ["The weather today is", "My favourite colour is", "Once upon a time,"]
BYSTANDER_PARAMS = [
    SamplingParams(temperature=0, max_tokens=1),
    SamplingParams(temperature=0, max_tokens=1),
    SamplingParams(use_beam_search=True, beam_width=2, max_tokens=12),
]


def generate(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]
             ) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


# ---- checks --------------------------------------------------------------------------------


def assert_same_outputs(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Token for token, with the same text and the same reason for stopping."""
    for i, (out, ref) in enumerate(zip(got, want, strict=True)):
        assert len(out.outputs) == len(ref.outputs), f"request {i}"
        for completion, expected in zip(out.outputs, ref.outputs, strict=True):
            a, b = completion.token_ids, expected.token_ids
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))
            assert a == b, (f"request {i}, choice {expected.index}: first difference at "
                            f"output token {first} of {len(a)} / {len(b)}: "
                            f"{completion.text!r} vs {expected.text!r}")
            assert completion.text == expected.text, f"request {i}"
            assert (completion.finish_reason, completion.stop_reason) == \
                (expected.finish_reason, expected.stop_reason), f"request {i}"


class Accepted:
    """Draft tokens verified and accepted by `llm`'s engine within a `with` block."""

    def __init__(self, llm: LLM) -> None:
        self.stats = llm.engine.speculator.stats

    def __enter__(self) -> "Accepted":
        self._start = (self.stats.num_draft_tokens, self.stats.num_accepted_tokens,
                       list(self.stats.accepted_per_position))
        return self

    def __exit__(self, *exc) -> None:
        drafts, accepted, per_position = self._start
        self.num_draft_tokens = self.stats.num_draft_tokens - drafts
        self.num_accepted_tokens = self.stats.num_accepted_tokens - accepted
        # rounds in which every one of the k drafts was accepted
        self.num_full_rounds = self.stats.accepted_per_position[-1] - per_position[-1]

    def assert_multi_token(self) -> None:
        assert self.num_draft_tokens > 0
        assert self.num_accepted_tokens > 0
        assert self.num_full_rounds > 0  # some steps emitted k + 1 tokens at once


@dataclass
class Batch:
    """Prompts, their params, and the engine's outputs for them without speculation."""

    prompts: list
    params: SamplingParams | list[SamplingParams]
    expected: list[RequestOutput]


def check_speculating(llm: LLM, batch: Batch) -> list[RequestOutput]:
    """`llm` (speculating) gives the batch's expected outputs, with multi-token rounds."""
    with Accepted(llm) as accepted:
        outputs = generate(llm, batch.prompts, batch.params)
    assert_same_outputs(outputs, batch.expected)
    accepted.assert_multi_token()
    # each request's own counts (the offline API's metrics) add up to the engine's
    metrics = [o.metrics for o in outputs]
    assert sum(m.num_draft_tokens for m in metrics) == accepted.num_draft_tokens
    assert sum(m.num_accepted_tokens for m in metrics) == accepted.num_accepted_tokens
    assert all(m.num_accepted_tokens <= m.num_draft_tokens for m in metrics)
    return outputs


# ---- 1. greedy, every method, batched with requests that do not speculate -----------------


@pytest.fixture(scope="module")
def mixed_batch(plain) -> Batch:
    prompts = mixed_prompts(plain.tokenizer)
    assert len(prompts) >= 8
    params = [GREEDY] * len(prompts) + BYSTANDER_PARAMS
    prompts += BYSTANDER_PROMPTS
    return Batch(prompts, params, generate(plain, prompts, params))


def drafted_share(batch: Batch) -> Batch:
    """Two requests of the batch that end on EOS, two that run to max_tokens, and the
    bystanders: what the methods that draft with a model (every round a forward per draft
    token) are checked on by default; their slow-tier case takes the whole batch."""
    drafted = len(BYSTANDER_PROMPTS)
    reasons = [o.outputs[0].finish_reason for o in batch.expected[:-drafted]]
    picked = ([i for i, r in enumerate(reasons) if r == "stop"][:2]
              + [i for i, r in enumerate(reasons) if r == "length"][:2])
    picked = sorted(picked) + list(range(len(reasons), len(batch.prompts)))
    params = batch.params if isinstance(batch.params, SamplingParams) else \
        [batch.params[i] for i in picked]
    return Batch([batch.prompts[i] for i in picked], params, [batch.expected[i] for i in picked])


@pytest.mark.parametrize(("method", "whole"), [
    ("ngram", True), ("self_draft", False), ("draft_model", False),
    pytest.param("self_draft", True, marks=pytest.mark.slow),
    pytest.param("draft_model", True, marks=pytest.mark.slow)])
def test_greedy_output_is_the_non_speculative_one(speculating, mixed_batch, method, whole):
    # some requests end on EOS, possibly inside a run of drafts; others run to max_tokens
    batch = mixed_batch if whole else drafted_share(mixed_batch)
    assert {o.outputs[0].finish_reason for o in batch.expected[:-len(BYSTANDER_PROMPTS)]} \
        == {"stop", "length"}
    check_speculating(speculating(method), batch)


def test_default_path_greedy_chat_is_the_non_speculative_one(smollm2_gguf, default_llm):
    """dtype auto (the checkpoint's quantized kernels), conversations through `LLM.chat`."""
    default = default_llm
    llm = build(smollm2_gguf, default.engine.loaded, spec_config("ngram", smollm2_gguf),
                dtype="auto")
    text = paragraphs()
    conversations = [
        [{"role": "user", "content": f"Repeat the following text exactly.\n\n{text[1]}"}],
        [{"role": "user", "content": "List the planets of the solar system."}],
        [{"role": "user", "content": f"Correct any mistakes in this code:\n\n{CODE}"}],
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]
    expected = default.chat(conversations, GREEDY, use_tqdm=False)
    with Accepted(llm) as accepted:
        outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    accepted.assert_multi_token()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_are_made_by_the_runner_after_its_forward_never_in_schedule(
        speculating, mixed_batch, method, monkeypatch):
    """`Scheduler.schedule()` runs no model code: every module's forward (the target's,
    the draft model's) and every proposal run inside the runner's step, each proposal
    after that step's target forward."""
    llm = speculating(method)
    engine = llm.engine
    where = {"schedule": False, "step_forward": False}
    events: list[tuple[str, bool]] = []  # (what ran, inside schedule())
    schedule = engine.scheduler.schedule

    def traced_schedule():
        where["schedule"], where["step_forward"] = True, False
        try:
            return schedule()
        finally:
            where["schedule"] = False

    proposer = engine.executor.runner.proposer
    propose = proposer.propose

    def traced_propose(seeds):
        events.append(("propose after the target's forward" if where["step_forward"]
                       else "propose before any forward", where["schedule"]))
        return propose(seeds)

    target = engine.loaded.model

    def note_forward(module, args):
        if module is target:
            where["step_forward"] = True
        events.append(("forward", where["schedule"]))

    monkeypatch.setattr(engine.scheduler, "schedule", traced_schedule)
    monkeypatch.setattr(proposer, "propose", traced_propose)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(note_forward)
    try:
        check_speculating(llm, drafted_share(mixed_batch))
    finally:
        handle.remove()
    kinds = {kind for kind, _ in events}
    assert kinds == {"forward", "propose after the target's forward"}, kinds
    assert not any(in_schedule for _, in_schedule in events)


# ---- 2. chunked prefill, preemption, prefix caching ----------------------------------------

# the draft model's runs of these are slow-tier: its greedy equality is checked above, and
# the scheduling paths below are the same for every proposer
SCENARIO_METHODS = ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)]


CHUNK = 32


@pytest.fixture(scope="module")
def long_prompts(smollm2_gguf, float32_weights) -> Batch:
    """Prompts of several chunks, prefilled 32 tokens a step."""
    prompts = [p for p in mixed_prompts(float32_weights.tokenizer)
               if isinstance(p, dict) and len(p["prompt_token_ids"]) > 2 * CHUNK]
    assert len(prompts) >= 4
    plain = build(smollm2_gguf, float32_weights, max_num_batched_tokens=CHUNK)
    return Batch(prompts, GREEDY, generate(plain, prompts, GREEDY))


@pytest.mark.parametrize("method", SCENARIO_METHODS)
def test_greedy_equal_with_chunked_prefill(smollm2_gguf, float32_weights, long_prompts,
                                           method):
    llm = build(smollm2_gguf, float32_weights, spec_config(method, smollm2_gguf),
                max_num_batched_tokens=CHUNK)
    check_speculating(llm, long_prompts)


def small_kv_cache(weights: LoadedModel, prompts: list) -> int:
    """Bytes for the longest request and two blocks more: the short prompts all start at
    once, then run out of blocks as they decode."""
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    per_token = kv_bytes_per_token(weights.config, torch.float32)
    return (longest + MAX_TOKENS + 32) * per_token


@pytest.fixture(scope="module")
def crowded(smollm2_gguf, float32_weights) -> Batch:
    """The six shortest prompts, with a KV cache too small for all their answers."""
    tokenizer = float32_weights.tokenizer
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": tokenizer.encode(p)}
               for p in mixed_prompts(tokenizer)]
    prompts = sorted(prompts, key=lambda p: len(p["prompt_token_ids"]))[:6]
    plain = build(smollm2_gguf, float32_weights,
                  kv_cache_memory=small_kv_cache(float32_weights, prompts))
    return Batch(prompts, GREEDY, generate(plain, prompts, GREEDY))


@pytest.mark.parametrize("method", SCENARIO_METHODS)
def test_greedy_equal_with_preemption(smollm2_gguf, float32_weights, crowded, method):
    llm = build(smollm2_gguf, float32_weights, spec_config(method, smollm2_gguf),
                kv_cache_memory=small_kv_cache(float32_weights, crowded.prompts))
    check_speculating(llm, crowded)
    assert llm.engine.scheduler.num_preemptions > 0


PREFIX_QUESTIONS = ["Repeat the passage exactly.", "Repeat its first two sentences.",
                    "Which objects does the passage name? List them."]


@pytest.fixture(scope="module")
def shared_prefix(smollm2_gguf, float32_weights) -> list[Batch]:
    """Three rounds on one engine: questions on one passage; the same again (their
    prompts now cached); continuations of the answers (cached up into the output)."""
    plain = build(smollm2_gguf, float32_weights)
    context = paragraphs()[3]
    assert len(plain.tokenizer.encode(context)) > 4 * plain.engine.kv_manager.block_size
    prompts = [chat(plain.tokenizer, f"{context}\n\n{q}") for q in PREFIX_QUESTIONS]
    rounds = [Batch(prompts, GREEDY, generate(plain, prompts, GREEDY)) for _ in range(2)]
    follow_ups = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids[:32]}
                  for o in rounds[0].expected]
    return rounds + [Batch(follow_ups, GREEDY, generate(plain, follow_ups, GREEDY))]


@pytest.mark.parametrize("method", SCENARIO_METHODS)
def test_greedy_equal_with_prefix_caching(smollm2_gguf, float32_weights, shared_prefix,
                                          method):
    llm = build(smollm2_gguf, float32_weights, spec_config(method, smollm2_gguf))
    outputs = []
    with Accepted(llm) as accepted:
        for batch in shared_prefix:
            outputs.append(generate(llm, batch.prompts, batch.params))
            assert_same_outputs(outputs[-1], batch.expected)
    accepted.assert_multi_token()
    first, again, follow_ups = outputs
    context = len(llm.tokenizer.encode(paragraphs()[3]))
    assert all(o.num_cached_tokens >= context for o in again)
    # the continuations' cached prefix reaches into speculatively decoded output
    assert all(o.num_cached_tokens > len(p.prompt_token_ids) + llm.engine.kv_manager.block_size
               for o, p in zip(follow_ups, first, strict=True))


# ---- 3. stop conditions inside a run of accepted drafts ------------------------------------
# (stop strings and logprobs in the default tier; exact max_tokens and stop token ids slow)


@pytest.fixture(scope="module")
def quote(plain) -> tuple[dict, RequestOutput]:
    """A prompt whose output copies its input (long runs of accepted drafts), and the
    non-speculative output, long enough to place stops inside."""
    prompt = chat(plain.tokenizer, f"Repeat the following text exactly.\n\n{paragraphs()[4]}")
    out = generate(plain, [prompt], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    return prompt, out


STOP_METHODS = SCENARIO_METHODS


@pytest.fixture(scope="module")
def lengths(plain, quote) -> Batch:
    prompt, _ = quote
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 3, 5, 6, 17, 50)]
    return Batch([prompt] * len(params), params, generate(plain, [prompt] * len(params), params))


@pytest.mark.parametrize("method", STOP_METHODS)
@pytest.mark.slow
def test_max_tokens_is_exact(speculating, lengths, method):
    outputs = check_speculating(speculating(method), lengths)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in lengths.params]
    assert {o.outputs[0].finish_reason for o in outputs} == {"length"}


@pytest.fixture(scope="module")
def stop_strings(plain, quote) -> Batch:
    """Stops of one to three words placed through the quote, with and without the stop
    string in the output."""
    prompt, full = quote
    words = full.outputs[0].text.split()
    stops = [" ".join(words[8:10]), words[21], " ".join(words[-6:-3])]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                             include_stop_str_in_output=include)
              for stop in stops for include in (False, True)]
    return Batch([prompt] * len(params), params, generate(plain, [prompt] * len(params), params))


@pytest.mark.parametrize("method", STOP_METHODS)
def test_stop_strings(speculating, stop_strings, method):
    outputs = check_speculating(speculating(method), stop_strings)
    for out, sp in zip(outputs, stop_strings.params, strict=True):
        completion = out.outputs[0]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", sp.stop[0])
        assert completion.text.endswith(sp.stop[0]) == sp.include_stop_str_in_output


@pytest.fixture(scope="module")
def stop_tokens(plain, quote) -> Batch:
    """Stops at tokens whose first occurrence is well inside the quote."""
    prompt, full = quote
    tokens = full.outputs[0].token_ids
    stop_ids = [t for i, t in enumerate(tokens) if i >= 10 and t not in tokens[:i]][::6][:4]
    assert len(stop_ids) >= 3
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[t])
              for t in stop_ids]
    expected = generate(plain, [prompt] * len(params), params)
    for out, stop_id in zip(expected, stop_ids, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens[: tokens.index(stop_id) + 1]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    return Batch([prompt] * len(params), params, expected)


@pytest.mark.parametrize("method", STOP_METHODS)
@pytest.mark.slow
def test_stop_token_ids(speculating, stop_tokens, method):
    check_speculating(speculating(method), stop_tokens)


@pytest.fixture(scope="module")
def with_logprobs(plain) -> Batch:
    prompts = mixed_prompts(plain.tokenizer)[:4]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    return Batch(prompts, params, generate(plain, prompts, params))


@pytest.mark.parametrize("method", STOP_METHODS)
def test_logprobs_are_the_non_speculative_ones(speculating, with_logprobs, method):
    outputs = check_speculating(speculating(method), with_logprobs)
    worst = 0.0
    for out, ref in zip(outputs, with_logprobs.expected, strict=True):
        got, want = out.outputs[0], ref.outputs[0]
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for entries, reference in zip(got.logprobs, want.logprobs, strict=True):
            assert entries.keys() == reference.keys()  # the sampled token and the top 2
            for token, lp in entries.items():
                worst = max(worst, abs(lp.logprob - reference[token].logprob))
                assert lp.rank == reference[token].rank
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    print(f"largest logprob difference: {worst:.2e}")
    assert worst <= 1e-4


# ---- 4. seeded sampling ----------------------------------------------------------------


def test_seeded_sampling_reproduces_run_to_run(smollm2_gguf, float32_weights):
    """Two engines of one config sample a seeded request alike, even when the second
    batches it in another order and beside other requests (which move the engine's own
    random state): the drafts' uniforms and the final draws come from the request's seed."""
    config = spec_config("ngram", smollm2_gguf)
    prompts = grounded_prompts(float32_weights.tokenizer)
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=MAX_TOKENS)
              for i in range(len(prompts))]
    first = build(smollm2_gguf, float32_weights, config)
    with Accepted(first) as accepted:
        expected = generate(first, prompts, params)
    accepted.assert_multi_token()
    second = build(smollm2_gguf, float32_weights, config)
    others = [SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS)]
    with Accepted(second) as accepted:
        outputs = generate(second, prompts[::-1] + prompts[:2], params[::-1] + others)
    accepted.assert_multi_token()
    assert_same_outputs(outputs[: len(prompts)][::-1], expected)
    reseeded = outputs[len(prompts)]  # the first prompt with another seed
    assert reseeded.outputs[0].token_ids != expected[0].outputs[0].token_ids


# ---- 5. structured output ------------------------------------------------------------------


@pytest.mark.slow
def test_json_schema_with_prompt_lookup(plain, speculating):
    example = json.dumps({"people": [{"name": "Alice", "age": 31, "city": "Paris"},
                                     {"name": "Bob", "age": 45, "city": "Rome"}]})
    tokenizer = plain.tokenizer
    prompts = [
        chat(tokenizer, f"Return exactly this JSON document:\n{example}"),
        chat(tokenizer, f"Here are two people as JSON: {example}\nAdd a third person, "
                        "Carol, 52, from Oslo, and return the JSON document."),
        chat(tokenizer, "Invent three people and return them as JSON with name, age and "
                        "city."),
    ]
    params = SamplingParams(temperature=0, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA))
    outputs = check_speculating(speculating("ngram"),
                                Batch(prompts, params, generate(plain, prompts, params)))
    validator = Draft202012Validator(PERSON_SCHEMA)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        errors = [e.message for e in validator.iter_errors(json.loads(completion.text))]
        assert not errors, (completion.text, errors)
