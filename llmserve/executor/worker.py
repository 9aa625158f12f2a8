"""A worker: rank r > 0 of an engine split over ranks (see `executor.py`).

It loads its share of the weights (its heads and channels of its pipeline stage's layers),
allocates its share of the KV cache, and runs every step rank 0 broadcasts, through the
same `ModelRunner` as rank 0 (its persistent batch, the paged attention over its KV heads,
the logits' all-gather), without sampling. On a pipeline a step begins when it arrives
(this stage's layers, the activations sent on); stage 0's ranks finish it (the logits)
when rank 0 says FINISH, steps begun in between.
"""

import collections
import logging
import os
import threading
import time

import torch

from llmserve.executor.ranks import (
    CALIBRATE,
    FINISH,
    ROWS,
    STEP,
    STOP,
    TIMING,
    CacheSpec,
    Ranks,
    WorkerSpec,
    all_gather_values,
    connect,
    receive_object,
    torchrun_env,
)

logger = logging.getLogger(__name__)


def run_worker(rank: int, size: int, host: str, port: int, device: str,
               num_threads: int | None, pipeline_size: int = 1) -> None:
    """Entry point of a spawned worker (`MultiprocExecutor`): it exits with its parent."""
    _exit_with_parent(os.getppid())
    if num_threads is not None:
        _set_threads(num_threads)
    serve_steps(connect(rank, size, host, port, torch.device(device), pipeline_size))


def run_ray_worker(rank: int, size: int, host: str, port: int, device: str,
                   num_threads: int | None, pipeline_size: int) -> None:
    """A rank as a Ray actor's method (`ray_executor.py`): returns once rank 0 says stop;
    raises (ending the call with the error) if rank 0 goes away."""
    if num_threads is not None:
        _set_threads(num_threads)
    serve_steps(connect(rank, size, host, port, torch.device(device), pipeline_size))


def run_external_worker(device: str = "cpu", pipeline_size: int = 1) -> None:
    """Entry point of a worker started by torchrun (RANK > 0)."""
    rank, size, host, port = torchrun_env()
    serve_steps(connect(rank, size, host, port + 1, torch.device(device), pipeline_size))


def serve_steps(ranks: Ranks) -> None:
    """Build this rank's model and cache as rank 0 says, then run steps until told to stop."""
    from llmserve.layers.attention.selector import attention_backend
    from llmserve.layers.kv_cache import KVCache
    from llmserve.loader import weight_cache
    from llmserve.loader.model_loader import load_model
    from llmserve.spec_decode.cost import measure_step_costs
    from llmserve.worker.model_runner import ModelRunner

    spec: WorkerSpec = receive_object(ranks.channels)
    if not isinstance(spec, WorkerSpec):  # rank 0 stopped before it said what to load
        return
    if spec.num_threads is not None:
        _set_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", ranks.tp.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if spec.stage_layers:
        ranks.stage.layers = spec.stage_layers[ranks.stage.index]
    loaded = load_model(spec.model, spec.dtype, device, spec.quantization,
                        enforce_eager=True, tp=ranks.tp, stage=ranks.stage)
    cache: CacheSpec = receive_object(ranks.channels)
    model = loaded.model
    cfg = loaded.config
    plan = getattr(model, "plan", None)
    attention = attention_backend(device, cache.attention_backend)
    layers = model.held_layers
    kv_cache = KVCache.allocate(
        len(layers), cache.num_blocks, cache.block_size,
        len(plan.attention.kv_heads) if plan else cfg.num_key_value_heads, cfg.head_dim,
        cache.dtype, device, zeroed=not attention.reads_only_written_slots,
        first_layer=layers.start)
    runner = ModelRunner(model, kv_cache, device, max_num_seqs=cache.max_num_seqs,
                         attention=attention, samples=False)
    stage = ranks.stage
    logger.info("rank %d of %d ready (tensor-parallel rank %d of %d, pipeline stage %d of "
                "%d: layers %d-%d)", ranks.control.rank(), ranks.world_size, ranks.tp.rank,
                ranks.tp.size, stage.index, stage.size, layers.start, layers.stop - 1)
    weight_cache.write_queued()
    begun = collections.deque()  # stage 0 of a pipeline: steps begun, not yet finished
    while True:
        try:
            kind, payload = receive_object(ranks.channels)
        except RuntimeError as exc:  # rank 0 is gone without saying stop
            logger.error("rank %d: rank 0 went away (%s); exiting", ranks.control.rank(),
                         str(exc).splitlines()[0][:200])
            raise SystemExit(1) from None
        if kind == STEP:
            accepted_drafts, out = payload
            for request_id, num_drafts, accepted in accepted_drafts:
                runner.input_batch.accept_drafts(request_id, num_drafts, accepted)
            flight = runner.begin(out)
            if stage.size > 1 and stage.is_first:
                begun.append(flight)
            else:
                runner.finish(flight)
        elif kind == FINISH:
            runner.finish(begun.popleft())
        elif kind == CALIBRATE:
            measure_step_costs(model, kv_cache, attention, payload)
        elif kind == ROWS:
            all_gather_values(ranks.control, [len(runner.input_batch.row_of)])
        elif kind == TIMING:
            all_gather_values(ranks.control, [stage.busy_seconds, stage.wait_seconds])
            if payload:
                stage.reset_timing()
        elif kind == STOP:
            stage.flush()
            ranks.channels.close()
            return


def _set_threads(num_threads: int) -> None:
    from llmserve.kernels import set_num_threads

    set_num_threads(num_threads)


def _exit_with_parent(parent: int) -> None:
    """A worker whose engine process is gone exits (it may be blocked in a collective)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="llmserve-parent-watch").start()
