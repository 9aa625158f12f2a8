"""`llmserve bench spec`: what speculative decoding buys, per method, path and workload.

Two parts, each engine alone on the machine (they run one after another):

* batch 1: each method (none, ngram, self_draft, and medusa or eagle with a head folder
  `llmserve train-heads` wrote) on each path (the default quantized one and the exact
  float32 one) decodes an input-grounded workload (quote, edit, summarise a
  passage, document code: the texts ship in `llmserve/bench/data/`) and open-ended chat,
  one request at a time, greedy. Reported: output tok/s, the speedup over no speculation
  on the same path, the acceptance rate, the mean accepted length, and whether the
  output equals the non-speculative one token for token (it must). With `--repeats N`
  the methods take turns N times on each workload and the speedup is the median of the
  run-by-run ratios (a machine whose speed drifts between runs moves both sides of a
  pair; a single run's ratio there is noise);
* concurrency: distinct prompts, grounded and chat in turn, at 1, 2, 4, ... concurrent
  requests, speculation always on (`disable_by_batch_size` lifted) with a fixed k and
  adaptive, against none; the first concurrency where it no longer pays is the crossover
  the default `disable_by_batch_size` comes from.
"""

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmserve.bench.machine import format_machine, machine_info, path_info
from llmserve.engine.engine import Engine
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data"
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the benefits of regular exercise? Explain in a few paragraphs.",
    "Explain how a bicycle works to a ten year old.",
    "Give me some practical tips for learning a new language as an adult.",
)


TASKS = (
    "Copy the following passage word for word.\n\n{}",
    "Rewrite the following passage, replacing the word \"people\" with \"folks\" and "
    "changing nothing else.\n\n{}",
    "Summarise the following passage, quoting its most important sentences exactly.\n\n{}",
)


def paragraphs() -> list[str]:
    text = (DATA / "quality_text.txt").read_text()
    return [p.strip() for p in text.split("\n\n") if len(p.split()) > 60]


def grounded_prompts() -> list[str]:
    """Quote, edit, summarise and document texts that ship with the package."""
    passages = paragraphs()
    code = (DATA / "spec_code.py.txt").read_text()
    return [
        TASKS[0].format(passages[0]), TASKS[1].format(passages[2]),
        TASKS[2].format(passages[4]),
        "Add a one-line docstring to every function and method of this code and return "
        f"the whole code.\n\n```python\n{code}```",
    ]


def mixed_prompts(n: int) -> list[str]:
    """n distinct prompts, grounded (each task on each passage) and chat in turn."""
    grounded = [task.format(p) for p in paragraphs() for task in TASKS]
    chat = [f"{q} (Answer number {i + 1}.)" for i in range(n) for q in CHAT_PROMPTS]
    mixed = [p for pair in zip(grounded, chat, strict=False) for p in pair]
    return (mixed + grounded[len(chat):] + chat[len(grounded):])[:n]


WORKLOADS = {"grounded": grounded_prompts, "chat": lambda: list(CHAT_PROMPTS)}


@dataclass
class SpecResult:
    path: str  # "default" or "float32"
    method: str  # "none", "ngram", "self_draft", "medusa", "eagle"
    workload: str
    concurrency: int
    output_tokens: int
    seconds: float
    num_draft_tokens: int
    num_accepted_tokens: int
    num_rounds: int
    identical: bool | None  # output equal to the same path without speculation
    # with repeats: each run's seconds, the methods of a workload taking turns (`seconds`
    # is their median); the speedup is then the median of the ratios run by run
    runs: list[float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_rounds if self.num_rounds else None


def chat_token_ids(llm: LLM, prompts: list[str]) -> list[dict]:
    return [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)}
        for p in prompts]


def run_workload(llm: LLM, prompts: list[dict], params: SamplingParams,
                 concurrency: int) -> tuple[float, list[list[int]], tuple[int, int, int]]:
    """Seconds, token ids per prompt, and the speculator's (drafts, accepted, rounds)
    during the run; `concurrency` prompts in flight at a time (in order)."""
    engine = llm.engine
    before = _spec_counts(engine)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        results = llm.generate(prompts[lo:lo + concurrency], params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in results]
    seconds = time.perf_counter() - start
    after = _spec_counts(engine)
    return seconds, outputs, tuple(a - b for a, b in zip(after, before, strict=True))


def _spec_counts(engine: Engine) -> tuple[int, int, int]:
    if engine.speculator is None:
        return (0, 0, 0)
    s = engine.speculator.stats
    return (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)


def engine_for(base: LLM, method: str, k: int, always_on: bool = False,
               adaptive: bool = True, heads: str | None = None) -> LLM:
    """An engine on `base`'s loaded target model, speculating with `method` ("none": off;
    medusa and eagle from the `heads` folder); `always_on`: whatever the batch size."""
    config = base.engine.config
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
        if heads is not None:
            spec["model"] = heads
        if always_on:
            spec["disable_by_batch_size"] = None
    return LLM.from_engine(Engine(replace(config, speculative_config=spec),
                                  loaded=base.engine.loaded))


def run_spec_bench(model: str | None, methods: list[str], paths: list[str], max_tokens: int,
                   concurrencies: list[int], k: int, kv_cache_memory: str = "1GiB",
                   log: Any = print, crossover_method: str = "ngram",
                   crossover_path: str = "default",
                   heads: dict[str, str] | None = None, repeats: int = 1) -> dict[str, Any]:
    """`heads`: the head folder of each of medusa and eagle among `methods`; `repeats`:
    the batch-1 runs of each workload, every method once a turn (`SpecResult.runs`)."""
    heads = heads or {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False)
    results: list[SpecResult] = []
    paths_seen: dict[str, Any] = {}
    for path in paths:
        dtype = "float32" if path == "float32" else "auto"
        base = LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory)
        paths_seen[path] = path_info(base)
        # self_draft is for the exact path (on the default one the target is the draft)
        engines = {m: base if m == "none" else engine_for(base, m, k, heads=heads.get(m))
                   for m in ["none", *[m for m in methods if m != "none" and not (
                       m == "self_draft" and path == "default")]]}
        for workload, make in WORKLOADS.items():
            prompts = chat_token_ids(base, make())
            for llm in engines.values():
                llm.generate(prompts[:1], replace(params, max_tokens=8), use_tqdm=False)
            runs: dict[str, list[tuple[float, list[list[int]], tuple[int, int, int]]]] = {
                m: [] for m in engines}
            for _ in range(repeats):  # the methods take turns: a drift touches them all
                for method, llm in engines.items():
                    runs[method].append(run_workload(llm, prompts, params, 1))
            reference = runs["none"][0][1]
            for method, done in runs.items():
                counts = [sum(c) for c in zip(*(r[2] for r in done), strict=True)]
                result = SpecResult(path, method, workload, 1, sum(map(len, done[0][1])),
                                    statistics.median(r[0] for r in done), *counts,
                                    None if method == "none" else
                                    all(r[1] == reference for r in done),
                                    [r[0] for r in done] if repeats > 1 else None)
                results.append(result)
                log(format_row(result, results))
    if concurrencies:
        results += run_crossover(model, k, max_tokens, concurrencies, kv_cache_memory, log,
                                 crossover_method, crossover_path)
    return {"machine": machine_info(), "paths": paths_seen, "num_speculative_tokens": k,
            "max_tokens": max_tokens, "repeats": repeats,
            "heads": {m: _head_info(f) for m, f in heads.items()},
            "results": [dict(vars(r), tokens_per_s=r.tokens_per_s,
                             acceptance_rate=r.acceptance_rate,
                             mean_accepted_length=r.mean_accepted_length,
                             speedup=speedup(r, b) if (b := _baseline(r, results)) else None)
                        for r in results],
            "crossover": crossover(results, f"{crossover_method}/fixed"),
            "crossover_adaptive": crossover(results, crossover_method)}


def _head_info(folder: str) -> dict[str, Any]:
    """How a head folder was made (`llmserve train-heads` writes it into config.json)."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {"folder": folder}
    return {"folder": folder, **(config.get("llmserve") or {})}


def run_crossover(model: str | None, k: int, max_tokens: int, concurrencies: list[int],
                  kv_cache_memory: str, log: Any = print, method: str = "ngram",
                  path: str = "default") -> list[SpecResult]:
    """Distinct prompts, grounded and chat in turn (`mixed_prompts`), at each concurrency
    on `path`, against none: `method` with a fixed k ("<method>/fixed") and adaptive
    ("<method>"), neither switched off by batch size."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    base = LLM(model, dtype="float32" if path == "float32" else "auto",
               kv_cache_memory=kv_cache_memory)
    engines = (("none", base),
               (f"{method}/fixed", engine_for(base, method, k, always_on=True,
                                             adaptive=False)),
               (method, engine_for(base, method, k, always_on=True)))
    prompts = chat_token_ids(base, mixed_prompts(max(concurrencies)))
    results = []
    for c in concurrencies:
        batch = prompts[:c]
        for name, llm in engines:
            llm.generate(batch[:1], replace(params, max_tokens=8), use_tqdm=False)
            seconds, outputs, (drafts, accepted, rounds) = run_workload(llm, batch, params, c)
            result = SpecResult(path, name, "crossover", c, sum(map(len, outputs)),
                                seconds, drafts, accepted, rounds, None)
            results.append(result)
            log(format_row(result, results))
    return results


def crossover(results: list[SpecResult], method: str = "ngram/fixed") -> int | None:
    """The lowest concurrency where `method` is no faster than none (crossover runs)."""
    by_c: dict[int, dict[str, float]] = {}
    for r in results:
        if r.workload == "crossover":
            by_c.setdefault(r.concurrency, {})[r.method] = r.tokens_per_s
    for c in sorted(by_c):
        rates = by_c[c]
        if method in rates and "none" in rates and rates[method] <= rates["none"]:
            return c
    return None


def _baseline(result: SpecResult, results: list[SpecResult]) -> SpecResult | None:
    for r in results:
        if (r.path, r.workload, r.concurrency, r.method) == (
                result.path, result.workload, result.concurrency, "none"):
            return r
    return None


HEADER = (f"{'path':<8} {'workload':<9} {'conc':>4} {'method':<11} {'tok/s':>7} "
          f"{'speedup':>7} {'accept':>6} {'len':>5} {'same':>5}")


def speedup(r: SpecResult, base: SpecResult) -> float:
    """r's speedup over `base` (none on the same path and workload): with repeats the
    median of the ratios of the runs that took turns, else the ratio of the rates."""
    if r.runs and base.runs and len(r.runs) == len(base.runs):
        return statistics.median(b / s for b, s in zip(base.runs, r.runs, strict=True))
    return r.tokens_per_s / base.tokens_per_s


def format_row(r: SpecResult, results: list[SpecResult]) -> str:
    base = _baseline(r, results)
    speedup_ = f"{speedup(r, base):.2f}x" if base else "-"
    accept = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else "-"
    length = f"{r.mean_accepted_length:.2f}" if r.mean_accepted_length is not None else "-"
    same = "-" if r.identical is None else ("yes" if r.identical else "NO")
    return (f"{r.path:<8} {r.workload:<9} {r.concurrency:>4} {r.method:<11} "
            f"{r.tokens_per_s:>7.1f} {speedup_:>7} {accept:>6} {length:>5} {same:>5}")


def format_report(data: dict[str, Any]) -> str:
    results = [SpecResult(**{k: v for k, v in r.items() if k in SpecResult.__dataclass_fields__})
               for r in data["results"]]
    lines = [format_machine(data["machine"])]
    for method, info in (data.get("heads") or {}).items():
        made = ", ".join(f"{k} {info[k]}" for k in (
            "answers", "answer_tokens", "train_positions", "seconds_generating",
            "seconds_hidden_states", "seconds_training", "held_out_tokens_per_round")
            if k in info)
        lines.append(f"{method} head: {info['folder']}" + (f" ({made})" if made else ""))
    lines.append(HEADER)
    lines += [format_row(r, results) for r in results]
    for key, what in (("crossover", "with a fixed k"), ("crossover_adaptive", "adaptive")):
        c = data.get(key)
        lines.append(f"speculation {what} stops paying at concurrency {c}" if c else
                     f"speculation {what} paid at every concurrency measured")
    return "\n".join(lines)
