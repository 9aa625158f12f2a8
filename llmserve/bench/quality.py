"""`llmserve bench quality`: how far a path's next-token distributions move from the exact
float32 path, on a fixed English text shipped with llmserve (`data/quality_text.txt`).

The text is cut into windows of `window` tokens, one every `stride` tokens; each window runs
as one prefill from position 0 (after the BOS token, when the tokenizer adds one), and each
text token is scored once, in the first window that reaches it::

    text   | window 0 ........ | window 1 ........ |        stride == window
    scored | 1 ............ w-1| w+1 ......... 2w-1|        (0 and w unscored without BOS)

Per scored token t, with p the reference's and q the candidate's next-token distribution:
perplexity = exp(mean -log q(t)), KL(p || q) = sum_v p(v) (log p(v) - log q(v)) averaged over
tokens, and top-1 agreement = how often argmax p == argmax q.

Side by side with llama.cpp (`--llama-perplexity BIN`, a GGUF model): its `llama-perplexity`
runs the same file on the same text, and every path here is scored as it scores
(`HalfWindowScoring`), so the perplexities compare directly.
"""

import gc
import importlib.resources
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.machine import format_machine, machine_info, path_info
from llmserve.core.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from llmserve.errors import LLMServeError
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

QUALITY_TEXT = "data/quality_text.txt"
REFERENCE_OPTIONS = {"dtype": "float32"}


def quality_text() -> str:
    """The shipped evaluation text (original prose written for llmserve, Apache-2.0)."""
    return importlib.resources.files("llmserve.bench").joinpath(QUALITY_TEXT).read_text("utf-8")


def full_logits(llm: LLM, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits (n, V), float32 on the CPU, at every position of one sequence, run as a single
    prefill through the engine's own model runner (its KV cache, dtype and quantization)."""
    hidden = full_hidden_states(llm, token_ids)
    with torch.inference_mode():
        return llm.engine.executor.runner.model.compute_logits(hidden).float().cpu()


def full_hidden_states(llm: LLM, token_ids: Sequence[int]) -> torch.Tensor:
    """The model's final hidden states (n, hidden) at every position of one sequence, as
    its forward returns them (what `compute_logits` takes), run as a single prefill
    through the engine's own model runner (its KV cache, dtype and quantization).

    The one place that knows how to get whole-sequence states out of an engine. The runner
    computes logits only where it samples, so a forward hook catches the hidden states
    the model returns. The sequence borrows free KV blocks from the engine's pool
    (evicting cached prefixes, as a request would) and gives them back.
    """
    engine = llm.engine
    runner = engine.executor.runner
    pool = engine.kv_manager.pool
    n = len(token_ids)
    max_len = getattr(engine, "max_model_len", None)
    if max_len is not None and n > max_len:
        raise LLMServeError(f"a window of {n} tokens is longer than the model's {max_len}: "
                            "give a smaller window")
    num_blocks = -(-n // runner.block_size)
    if num_blocks > pool.num_free_blocks:
        raise LLMServeError(
            f"a window of {n} tokens needs {num_blocks} KV blocks and the cache has "
            f"{pool.num_free_blocks} free: give a larger kv_cache_memory or a smaller window")
    blocks = pool.get_new_blocks(num_blocks)
    request_id = "bench-quality"
    new = NewRequestData(request_id, list(token_ids), SamplingParams(max_tokens=1),
                         [b.block_id for b in blocks])
    step = SchedulerOutput(scheduled=[ScheduledRequest(
        request_id, list(token_ids), start_position=0, new_block_ids=[], sample=False,
        new=new)])
    captured: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda _m, _args, out: captured.append(out))
    try:
        runner.execute_model(step)
    finally:
        hook.remove()
        runner.execute_model(SchedulerOutput(finished_request_ids={request_id}))  # drop its row
        pool.free_blocks(blocks)
    return captured[0]


def added_bos(tokenizer) -> int | None:
    """The BOS token id where the tokenizer puts one before a text, else None."""
    bos = tokenizer.bos_token_id
    adds = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
    return bos if adds else None


@dataclass(frozen=True)
class Window:
    """Text tokens [start, end) run together; [first_scored, end) are scored here."""

    start: int
    end: int
    first_scored: int


def plan_windows(num_tokens: int, window: int, stride: int, has_bos: bool) -> list[Window]:
    """Windows covering `num_tokens` so that every token is scored exactly once (the first
    token of the text, and of each window, only when a BOS token precedes it)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError("--window must be at least 2 and --stride between 1 and --window")
    windows, scored_end = [], 0
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        first = max(scored_end, start if has_bos else start + 1)
        if first < end:
            windows.append(Window(start, end, first))
        scored_end = end
        if end == num_tokens:
            break
    return windows


@dataclass
class QualityText:
    """The tokenized text, its windows, and the reference's log-probs per window."""

    ids: list[int]
    prefix: list[int]  # [BOS] when the tokenizer adds one, else []
    windows: list[Window]
    reference: list[torch.Tensor] = field(default_factory=list)  # (scored, V) per window
    reference_half_window_perplexity: float | None = None  # scored as llama.cpp scores

    @classmethod
    def build(cls, llm: LLM, text: str, window: int, stride: int,
              max_tokens: int | None = None) -> "QualityText":
        tokenizer = llm.tokenizer
        ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        bos = added_bos(tokenizer)
        prefix = [] if bos is None else [bos]
        if len(ids) < 2:
            raise ValueError("the text is shorter than 2 tokens")
        return cls(ids, prefix, plan_windows(len(ids), window, stride, bool(prefix)))

    @property
    def num_scored(self) -> int:
        return sum(w.end - w.first_scored for w in self.windows)

    def logprobs(self, llm: LLM, w: Window) -> torch.Tensor:
        """Log-probs (scored, V) that `llm` gives the scored tokens of window `w`."""
        logits = full_logits(llm, self.prefix + self.ids[w.start:w.end])  # (len, V)
        offset = len(self.prefix) - w.start - 1  # row predicting text token t: t + offset
        return logits[w.first_scored + offset:w.end + offset].log_softmax(dim=-1)

    def targets(self, w: Window) -> torch.Tensor:
        return torch.tensor(self.ids[w.first_scored:w.end])

    def score_reference(self, llm: LLM) -> None:
        self.reference = [self.logprobs(llm, w) for w in self.windows]


@dataclass(frozen=True)
class HalfWindowScoring:
    """llama.cpp's `llama-perplexity` scoring: the text tokenized with its special tokens,
    cut into back-to-back windows of `window` tokens (a shorter tail dropped), each window's
    first token replaced by BOS where the tokenizer adds one, and in each window only the
    tokens of its second half scored (positions window/2 + 1 .. window - 1, each predicted
    from everything before it in its window)."""

    ids: list[int]
    window: int
    bos: int | None

    @classmethod
    def build(cls, llm: LLM, text: str, window: int) -> "HalfWindowScoring":
        ids = llm.tokenizer.encode(text, add_special_tokens=True)
        if len(ids) < 2 * window:
            raise LLMServeError(f"llama.cpp's scoring needs {2 * window} tokens of text (two "
                                f"windows), the text has {len(ids)}: give a smaller window")
        return cls(ids, window, added_bos(llm.tokenizer))

    @property
    def num_windows(self) -> int:
        return len(self.ids) // self.window

    @property
    def num_scored(self) -> int:
        return self.num_windows * (self.window - self.window // 2 - 1)

    def perplexity(self, llm: LLM) -> float:
        w, first, nll = self.window, self.window // 2, 0.0
        for i in range(self.num_windows):
            chunk = self.ids[i * w:(i + 1) * w]
            if self.bos is not None:
                chunk = [self.bos, *chunk[1:]]
            logprobs = full_logits(llm, chunk)[first:w - 1].log_softmax(dim=-1)
            targets = torch.tensor(chunk[first + 1:w]).unsqueeze(1)
            nll -= logprobs.gather(1, targets).double().sum().item()
        return _exp(nll / self.num_scored)


def llama_cpp_perplexity(binary: str, model_path: str, text: str, window: int,
                         threads: int | None) -> dict[str, Any]:
    """llama.cpp's `llama-perplexity` on `model_path` and `text`, windows of `window`:
    {"perplexity", "stderr", "windows", "command"} (an LLMServeError if it fails)."""
    with tempfile.TemporaryDirectory() as folder:
        text_file = Path(folder) / "text.txt"
        text_file.write_text(text, encoding="utf-8")
        cmd = [binary, "-m", model_path, "-f", str(text_file), "-c", str(window), "-b",
               str(window), "-t", str(threads or os.cpu_count() or 1)]
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).resolve().parent)}
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LLMServeError(f"--llama-perplexity: {e}") from None
    log = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if done.returncode or final is None:
        raise LLMServeError(f"--llama-perplexity exited {done.returncode}: {log[-1500:]}")
    return {"perplexity": float(final.group(1)), "stderr": float(final.group(2)),
            "windows": int(chunks.group(1)) if chunks else None,
            "command": " ".join([Path(binary).name, "-m", "MODEL", "-f", "TEXT", *cmd[5:]])}


@dataclass(frozen=True)
class QualityResult:
    label: str
    options: dict[str, Any]  # what LLM(...) was given
    path: dict[str, Any]  # what it runs: dtype, quantization, KV dtype, device
    num_tokens: int
    reference_perplexity: float
    perplexity: float
    mean_kl: float  # KL(reference || candidate), nats per token
    top1_agreement: float
    half_window_perplexity: float | None = None  # scored as llama.cpp scores

    @property
    def perplexity_change_pct(self) -> float:
        return 100.0 * (self.perplexity / self.reference_perplexity - 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity_change_pct": self.perplexity_change_pct}


def evaluate(llm: LLM, text: QualityText, label: str = "candidate",
             options: dict[str, Any] | None = None,
             half: HalfWindowScoring | None = None) -> QualityResult:
    """Compare `llm` with the reference log-probs `text` holds, token by token (and score
    it as llama.cpp does where `half` is given)."""
    if not text.reference:
        raise ValueError("score the reference first (QualityText.score_reference)")
    ref_nll = nll = kl = agree = 0.0
    for w, ref in zip(text.windows, text.reference, strict=True):
        cand = text.logprobs(llm, w)  # (scored, V), as ref
        if cand.shape != ref.shape:
            raise LLMServeError(f"{label}: logits of shape {tuple(cand.shape)}, the "
                                f"reference's are {tuple(ref.shape)}")
        targets = text.targets(w).unsqueeze(1)  # (scored, 1)
        ref_nll -= ref.gather(1, targets).double().sum().item()
        nll -= cand.gather(1, targets).double().sum().item()
        p = ref.exp()
        kl += torch.where(p > 0, p * (ref - cand), 0.0).sum(dim=-1).double().sum().item()
        agree += (ref.argmax(dim=-1) == cand.argmax(dim=-1)).sum().item()
    n = text.num_scored
    return QualityResult(label, dict(options or {}), path_info(llm), n, _exp(ref_nll / n),
                         _exp(nll / n), kl / n, agree / n,
                         None if half is None else half.perplexity(llm))


def _exp(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).exp())


def load_llm(model: str | None, options: dict[str, Any]) -> LLM:
    """`LLM(model, **options)`; an option this llmserve does not know is a one-line error."""
    try:
        return LLM(model, **options)
    except TypeError as e:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise LLMServeError(f"the engine rejected the options {given}: {e}") from None


def candidate_label(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "default (dtype auto)"


def run_quality(model: str | None, candidates: list[dict[str, Any]],
                common: dict[str, Any] | None = None, text: str | None = None,
                window: int = 512, stride: int = 512, max_tokens: int | None = None,
                half_windows: bool = False) -> tuple[QualityText, list[QualityResult]]:
    """Score the reference (`dtype="float32"`), then each candidate, one model in memory at
    a time; `common` options (device, kv_cache_memory) go to every one of them.
    `half_windows`: each is scored as llama.cpp scores too (`HalfWindowScoring`; the
    reference's perplexity so is `QualityText.reference_half_window_perplexity`)."""
    common = common or {}
    reference = load_llm(model, {**common, **REFERENCE_OPTIONS})
    raw = quality_text() if text is None else text
    scored = QualityText.build(reference, raw, window, stride, max_tokens)
    scored.score_reference(reference)
    half = HalfWindowScoring.build(reference, raw, window) if half_windows else None
    if half is not None:
        scored.reference_half_window_perplexity = half.perplexity(reference)
    del reference
    results = []
    for options in candidates:
        gc.collect()
        llm = load_llm(model, {**common, **options})
        results.append(evaluate(llm, scored, candidate_label(options), options, half))
        del llm
    return scored, results


def format_table(text: QualityText, results: list[QualityResult], window: int,
                 stride: int, source: str) -> str:
    ref_ppl = results[0].reference_perplexity if results else float("nan")
    # columns as wide as their longest entry (a label with several engine args is long)
    label_width = max([len("candidate"), *(len(r.label) for r in results)]) + 2
    runs_width = max([len("runs as"), *(len(_runs_as(r.path)) for r in results)]) + 2
    lines = [format_machine(),
             f"text: {source}, {text.num_scored} tokens scored in {len(text.windows)} "
             f"windows of {window} (stride {stride})",
             f"reference: dtype float32, perplexity {ref_ppl:.4f}",
             f"{'candidate':<{label_width}}{'runs as':<{runs_width}}{'perplexity':>11}"
             f"{'change':>9}{'mean KL':>10}{'top-1':>9}"]
    for r in results:
        lines.append(f"{r.label:<{label_width}}{_runs_as(r.path):<{runs_width}}"
                     f"{r.perplexity:>11.4f}{r.perplexity_change_pct:>+8.2f}%{r.mean_kl:>10.2e}"
                     f"{r.top1_agreement:>9.2%}")
    lines.append("(KL: mean KL(reference || candidate) in nats per token; top-1: share of "
                 "tokens whose most likely next token is the reference's)")
    return "\n".join(lines)


def format_peer_table(text: QualityText, results: list[QualityResult], peer: dict[str, Any],
                      window: int) -> str:
    """The paths against llama.cpp's `llama-perplexity` on the same file, all scored as it
    scores."""
    lines = [f"side by side with llama.cpp ({peer['command']}): the second half of each of "
             f"{peer['windows']} windows of {window} scored, as llama-perplexity scores",
             f"{'path':<28}{'perplexity':>11}{'vs llama.cpp':>14}",
             f"{'llama.cpp llama-perplexity':<28}{peer['perplexity']:>11.4f}{'':>14}"
             f"  (+/- {peer['stderr']:.4f})"]
    rows = [("llmserve float32 (exact)", text.reference_half_window_perplexity)]
    rows += [(f"llmserve {_runs_as(r.path).split(',')[0]}", r.half_window_perplexity)
             for r in results]
    for label, ppl in rows:
        lines.append(f"{label:<28}{ppl:>11.4f}{100 * (ppl / peer['perplexity'] - 1):>+13.2f}%")
    return "\n".join(lines)


def _runs_as(path: dict[str, Any]) -> str:
    """E.g. "float32 int8, KV bfloat16"."""
    weights = f"{path['dtype']} {path['quantization']}" if path["quantization"] else path["dtype"]
    return f"{weights}, KV {path['kv_cache_dtype']}"


def report(model: str | None, text: QualityText, results: list[QualityResult], window: int,
           stride: int, source: str, common: dict[str, Any],
           peer: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"model": model, "machine": machine_info(), "text": source,
            "num_text_tokens": len(text.ids), "num_scored_tokens": text.num_scored,
            "window": window, "stride": stride, "common_options": common,
            "reference": {"options": REFERENCE_OPTIONS,
                          "perplexity": results[0].reference_perplexity if results else None,
                          "half_window_perplexity": text.reference_half_window_perplexity},
            "candidates": [r.to_dict() for r in results], "llama.cpp": peer}


def read_text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LLMServeError(f"cannot read {path}: {e}") from None
