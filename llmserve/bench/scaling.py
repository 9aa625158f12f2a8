"""`llmserve bench scaling`: tensor and pipeline parallelism and disaggregated
prefill/decode on this machine (a small one: the ranks and the roles share its cores, so
the figures are costs, not speed-ups; `docs/scaling.md` says what they imply on a
multi-GPU node or over several hosts).

* Tensor x pipeline parallelism: offline generation (greedy, fixed output length) at each
  layout (`tensor_parallel_size` x `pipeline_parallel_size`) and batch size: output tok/s,
  the ratio to one process, the share of rank 0's generation time spent inside the
  model's collectives (the all-reduces after o_proj and down_proj, the embedding's
  all-reduce, the logits' all-gather; waiting for a slower rank counts as collective
  time, as it would on any machine), and each pipeline stage's busy share: the time its
  first rank computed (its layers; stage 0 also the embedding, logits and sampling) over
  the generation's time. A stage idle while the others work is the pipeline's bubble:
  with one batch in flight per stage under load every share nears 1. Rank 0 also runs the
  engine (scheduling, detokenizing): its process's CPU time over the generation's time is
  shown beside (its threads' sum: above 100 % where it computes on several).
* Disaggregation: a prefill engine and a decode engine in this process, connected as the
  servers are (gloo): per prompt length, the KV bytes transferred, the time on the wire
  and the rate, against the time the prefill took (what the decode engine saved); the
  decode engine's computed prompt tokens stay 0.
"""

import random
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from llmserve.bench.machine import machine_info
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.executor.ranks import free_port
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

TP_HEADER = (f"{'TP':>3} {'PP':>3} {'batch':>5} {'in':>5} {'out':>4} {'seconds':>8} "
             f"{'tok/s':>8} {'vs 1':>6} {'collectives':>11} {'rank 0 CPU':>10}  stage busy")
PD_HEADER = (f"{'prompt':>6} {'blocks':>6} {'KV MB':>8} {'wire ms':>8} {'MB/s':>8} "
             f"{'prefill ms':>10} {'decode prefill':>14}")


@dataclass
class TPResult:
    tensor_parallel_size: int
    batch: int
    input_len: int
    output_len: int
    seconds: float
    tokens_per_s: float
    collective_seconds: float  # rank 0, inside all-reduce / all-gather
    pipeline_parallel_size: int = 1
    stage_busy_seconds: tuple[float, ...] = ()  # each stage's first rank, computing
    rank0_cpu_seconds: float = 0.0  # rank 0's process, all its threads

    @property
    def collective_share(self) -> float:
        return self.collective_seconds / self.seconds if self.seconds else 0.0


@dataclass
class TransferResult:
    prompt_tokens: int
    num_blocks: int
    kv_bytes: int
    wire_seconds: float
    prefill_seconds: float
    decode_computed_prompt_tokens: int

    @property
    def megabytes_per_s(self) -> float:
        return self.kv_bytes / 1e6 / self.wire_seconds if self.wire_seconds else 0.0


def synthetic_prompts(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(count)]


def run_tp(model: str | None, dtype: str, layouts: list[tuple[int, int]], batches: list[int],
           input_len: int, output_len: int, log: Any = print) -> list[TPResult]:
    """Each (tensor, pipeline) parallel layout at each batch size."""
    results: list[TPResult] = []
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for size, stages in layouts:
        llm = LLM(model, dtype=dtype, tensor_parallel_size=size,
                  pipeline_parallel_size=stages, kv_cache_memory="512MiB")
        try:
            vocab = llm.engine.loaded.config.vocab_size
            plan = getattr(llm.engine.loaded.model, "plan", None)
            executor = llm.engine.executor
            for batch in batches:
                prompts = synthetic_prompts(vocab, batch, input_len, seed=batch)
                llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)  # warm
                if plan is not None:
                    plan.tp.reset_timing()
                if stages > 1:
                    executor.stage_seconds(reset=True)
                prompts = synthetic_prompts(vocab, batch, input_len, seed=1000 + batch)
                start, cpu = time.perf_counter(), time.process_time()
                llm.generate(prompts, params, use_tqdm=False)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                comm = plan.tp.comm_seconds if plan is not None else 0.0
                busy = tuple(busy for busy, _ in executor.stage_seconds()[::size]) \
                    if stages > 1 else ()
                result = TPResult(size, batch, input_len, output_len, seconds,
                                  batch * output_len / seconds, comm, stages, busy, cpu)
                results.append(result)
                log(format_tp_row(result, results))
        finally:
            llm.engine.shutdown()
    return results


def format_tp_row(r: TPResult, results: list[TPResult]) -> str:
    base = next((b for b in results if b.tensor_parallel_size == 1 and b.batch == r.batch
                 and b.pipeline_parallel_size == 1), None)
    ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
    share = f"{100 * r.collective_share:.0f} %" if r.tensor_parallel_size > 1 else "-"
    busy = " / ".join(f"{100 * b / r.seconds:.0f} %" for b in r.stage_busy_seconds) or "-"
    cpu = f"{100 * r.rank0_cpu_seconds / r.seconds:.0f} %"
    return (f"{r.tensor_parallel_size:>3} {r.pipeline_parallel_size:>3} {r.batch:>5} "
            f"{r.input_len:>5} {r.output_len:>4} {r.seconds:>8.2f} {r.tokens_per_s:>8.1f} "
            f"{ratio:>6} {share:>11} {cpu:>10}  {busy}")


def run_disaggregated(model: str | None, dtype: str, prompt_lens: list[int],
                      log: Any = print) -> list[TransferResult]:
    address = f"127.0.0.1:{free_port()}"
    common = {"model": model, "dtype": dtype, "kv_cache_memory": "512MiB",
              "kv_transfer_address": address}
    decode: list[Engine] = []
    # both sides block until the other is there: the decode engine starts on a thread
    starter = threading.Thread(target=lambda: decode.append(
        Engine(EngineConfig(kv_role="decode", **common))))
    starter.start()
    prefill = Engine(EngineConfig(kv_role="prefill", **common))
    starter.join()
    (decoder,) = decode
    results = []
    vocab = prefill.loaded.config.vocab_size
    block_size = prefill.kv_manager.block_size
    for length in prompt_lens:
        (prompt,) = synthetic_prompts(vocab, 1, length, seed=length)
        transfer_id = uuid.uuid4().hex
        start = time.perf_counter()
        prefill.add_request(prompt, SamplingParams(temperature=0, max_tokens=1),
                            kv_transfer=transfer_id)
        while prefill.has_unfinished_requests():
            prefill.step()
        prefill_seconds = time.perf_counter() - start
        received = decoder.kv_connector.wait_for(transfer_id, 120)
        computed_before = decoder.num_prefill_computed_tokens
        decoder.add_request(prompt, SamplingParams(temperature=0, max_tokens=8),
                            kv_transfer=received)
        while decoder.has_unfinished_requests():
            decoder.step()
        result = TransferResult(length, -(-length // block_size), received.num_bytes,
                                received.seconds, prefill_seconds,
                                decoder.num_prefill_computed_tokens - computed_before)
        results.append(result)
        log(format_pd_row(result))
    return results


def format_pd_row(r: TransferResult) -> str:
    return (f"{r.prompt_tokens:>6} {r.num_blocks:>6} {r.kv_bytes / 1e6:>8.2f} "
            f"{1000 * r.wire_seconds:>8.1f} {r.megabytes_per_s:>8.0f} "
            f"{1000 * r.prefill_seconds:>10.1f} {r.decode_computed_prompt_tokens:>14}")


def run_scaling_bench(model: str | None, dtype: str, layouts: list[tuple[int, int]],
                      batches: list[int], input_len: int, output_len: int,
                      prompt_lens: list[int], log: Any = print) -> dict[str, Any]:
    log(TP_HEADER)
    tp = run_tp(model, dtype, layouts, batches, input_len, output_len, log)
    pd: list[TransferResult] = []
    if prompt_lens:
        log("")
        log(PD_HEADER)
        pd = run_disaggregated(model, dtype, prompt_lens, log)
    return {"machine": machine_info(), "dtype": dtype,
            "tensor_parallel": [{**asdict(r), "tokens_per_s": r.tokens_per_s,
                                 "collective_share": r.collective_share,
                                 "stage_busy_share": [b / r.seconds
                                                      for b in r.stage_busy_seconds]}
                                for r in tp],
            "disaggregated": [{**asdict(r), "megabytes_per_s": r.megabytes_per_s}
                              for r in pd]}
