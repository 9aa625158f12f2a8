"""Offline throughput: N synthetic prompts of exactly `input_len` tokens, each generating
exactly `output_len` tokens (greedy, EOS ignored), through `LLM.generate`; with
`random_output_len`, request i generates a length drawn uniformly from [1, 2 x output_len
- 1] instead (mean `output_len`, seeded), as real traffic's answers differ in length.

`batched` submits every prompt at once (continuous batching, under the engine's scheduling
policy); `static` submits them at once to the same engine switched to static batching (a
batch runs to completion before the next is admitted: with lengths that differ, a batch
waits for its longest member); `sequential` runs the same engine one request at a time, the
baseline batching is measured against. Each run gets its own prompts (a different seed) so
a later run never hits the prefix cache of an earlier one.
"""

import dataclasses
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from llmserve.bench.machine import format_machine, format_path, machine_info, path_info
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

Mode = Literal["batched", "static", "sequential"]
_WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class ThroughputResult:
    """One timed run; rates are over the wall-clock time of the whole run."""

    mode: Mode
    input_len: int
    output_len: int
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def synthetic_prompts(
    llm: LLM, num_prompts: int, input_len: int, seed: int
) -> list[dict[str, list[int]]]:
    """`num_prompts` prompts of exactly `input_len` random token ids, no special tokens."""
    special = set(llm.tokenizer.all_special_ids)
    vocab = min(llm.tokenizer.vocab_size, llm.engine.loaded.config.vocab_size)
    candidates = [t for t in range(vocab) if t not in special]
    rng = random.Random(seed)
    return [{"prompt_token_ids": rng.choices(candidates, k=input_len)} for _ in range(num_prompts)]


def run_throughput(
    llm: LLM,
    num_prompts: int,
    input_len: int,
    output_len: int,
    mode: Mode = "batched",
    seed: int = 0,
    use_tqdm: bool = True,
    random_output_len: bool = False,
    lengths_seed: int = 0,
) -> ThroughputResult:
    """Time `num_prompts` requests of `input_len` + `output_len` tokens in `mode`. The
    random output lengths come from `lengths_seed`, so that runs in different modes (whose
    prompts differ, by `seed`) generate the same numbers of tokens."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in output_lens(num_prompts, output_len, random_output_len, lengths_seed)]
    warmup = synthetic_prompts(llm, 1, input_len, seed=-1 - seed)
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=_WARMUP_OUTPUT_LEN,
                                        ignore_eos=True), use_tqdm=False)
    prompts = synthetic_prompts(llm, num_prompts, input_len, seed)
    scheduler = llm.engine.scheduler
    policy = scheduler.config
    start = time.perf_counter()
    if mode == "sequential":
        outputs = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params,
                                                                           strict=True)]
    else:
        if mode == "static":  # the same engine, batch by batch
            scheduler.config = dataclasses.replace(policy, policy="static")
        try:
            outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        finally:
            scheduler.config = policy
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        mode=mode,
        input_len=input_len,
        output_len=output_len,
        num_requests=len(outputs),
        num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
    )


def output_lens(num_prompts: int, output_len: int, random_lengths: bool, seed: int
                ) -> list[int]:
    """Every request's output length: `output_len`, or uniform in [1, 2 x output_len - 1]."""
    if not random_lengths:
        return [output_len] * num_prompts
    rng = random.Random(seed)
    return [rng.randint(1, 2 * output_len - 1) for _ in range(num_prompts)]


def report(llm: LLM, results: list[ThroughputResult], seed: int) -> dict[str, Any]:
    """The JSON report: the setup, one entry per run, and the batched/sequential ratio."""
    by_mode = {r.mode: r for r in results}
    ratio = static = None
    if {"batched", "sequential"} <= by_mode.keys():
        ratio = by_mode["batched"].output_tokens_per_s / by_mode["sequential"].output_tokens_per_s
    if {"batched", "static"} <= by_mode.keys():
        static = by_mode["batched"].output_tokens_per_s / by_mode["static"].output_tokens_per_s
    return {
        "model": llm.engine.loaded.source.name,
        **path_info(llm),
        "machine": machine_info(),
        "num_prompts": results[0].num_requests,
        "input_len": results[0].input_len,
        "output_len": results[0].output_len,
        "seed": seed,
        "scheduling_policy": llm.engine.config.scheduling_policy,
        "runs": [r.to_dict() for r in results],
        "batched_over_sequential": ratio,
        "batched_over_static": static,
    }


def format_table(results: list[ThroughputResult], llm: LLM | None = None) -> str:
    """A fixed-width table, one row per run, under the machine (and the engine's path)."""
    header = (f"{'mode':<11}{'requests':>9}{'time (s)':>10}{'req/s':>9}{'out tok/s':>11}"
              f"{'tok/s':>10}")
    rows = [
        f"{r.mode:<11}{r.num_requests:>9}{r.elapsed_s:>10.2f}{r.requests_per_s:>9.2f}"
        f"{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>10.1f}"
        for r in results
    ]
    path = []
    if llm is not None:
        path = [f"{format_path(path_info(llm))}; scheduling "
                f"{llm.engine.config.scheduling_policy}"]
    return "\n".join([format_machine(), *path, header, *rows])
