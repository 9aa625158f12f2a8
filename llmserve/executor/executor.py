"""The ranks of a tensor-parallel engine and how rank 0 drives them.

Rank 0 is the engine: it schedules, runs its own share of the model and samples. Every
other rank is a worker (`worker.py`) that holds its share of the weights and of the KV
cache (its KV heads) and runs each step rank 0 sends it: rank 0 broadcasts the step's
`SchedulerOutput` (incremental: a request's data once, then ids, token counts and new
block ids) before running it, and the ranks meet in the step's all-reduces.

Launch (`--distributed-executor-backend`):
* `mp` (default): rank 0 starts the workers itself on this machine (spawned processes);
  they die with it (each worker watches its parent), and `shutdown` stops them.
* `external_launcher`: every rank is started by `torchrun` (one machine or several:
  `--nnodes`, `--master-addr`); the process with RANK 0 serves, the others run
  `worker.run_external_worker` (the CLI does this), all meeting at MASTER_ADDR:MASTER_PORT.

Communication is `torch.distributed`: one process group per engine (gloo on the CPU, and
NCCL for the model's tensors on CUDA), made from its own TCP store, so several engines can
live in one process. A worker that dies is seen within a second (`failure`); the step in
flight fails, and the engine reports itself unavailable.
"""

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from typing import Any

import torch

from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.distributed.parallel import TensorParallel
from llmserve.distributed.pipeline import PipelineStage
from llmserve.executor.abstract import Executor
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
    broadcast_object,
    connect,
    free_port,
    torchrun_env,
)
from llmserve.executor.worker import run_worker
from llmserve.worker.model_runner import ModelRunner, StepInFlight

logger = logging.getLogger(__name__)


class TensorParallelExecutor(Executor):
    """Rank 0's handle on the workers and its own runner (`bind_runner`, once the model is
    loaded): each step goes to the workers, then runs on rank 0's runner."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.failure: str | None = None  # why the group is broken, once it is
        self._stopped = False
        # (request, drafts sent, drafts accepted) verified since the workers last heard
        self._accepted_drafts: list[tuple[str, int, list[int]]] = []
        self.stage_split: tuple[range, ...] = ()  # a pipeline's layers per stage
        atexit.register(self.shutdown)  # the workers stop with this process

    def bind_runner(self, runner: ModelRunner) -> "TensorParallelExecutor":
        self.runner = runner
        return self

    @property
    def tp(self) -> TensorParallel:
        return self.ranks.tp

    def start_workers(self, spec: WorkerSpec) -> None:
        self._send(spec)

    def allocate_caches(self, spec: CacheSpec) -> None:
        self._send(spec)

    @property
    def stage(self) -> PipelineStage:
        return self.ranks.stage

    @property
    def pipeline_depth(self) -> int:
        return self.ranks.stage.size

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.begin(out))

    def begin(self, out: SchedulerOutput) -> StepInFlight:
        """Send the step, with the drafts rank 0 accepted since the last one (the workers'
        persistent batches learn them before the step), then run it here up to its
        forward (the ranks meet in its collectives; a pipeline's later stages go on
        with it while rank 0 begins the next)."""
        self._send((STEP, (self._accepted_drafts, out.for_workers())))
        self._accepted_drafts = []
        return self.runner.begin(out)

    def finish(self, flight: StepInFlight) -> ModelRunnerOutput:
        """The step's output: on a pipeline, once its last stage sent the final hidden
        states (stage 0's other ranks join the logits' all-gather)."""
        if self.stage.size > 1 and self.tp.size > 1:
            self._send((FINISH, None), range(1, self.tp.size))
        result = self.runner.finish(flight)
        out = flight.out
        for s, tokens in zip(out.scheduled, result.sampled_token_ids, strict=True):
            if s.spec_token_ids and tokens:
                self._accepted_drafts.append((s.request_id, len(s.spec_token_ids), tokens[:-1]))
        return result

    def calibrate(self, num_drafts: int) -> None:
        """The workers join the speculative decoding cost calibration rank 0 runs next
        (`spec_decode/cost.py`: the same forwards, so the collectives meet)."""
        self._send((CALIBRATE, num_drafts))

    def rows_held(self) -> list[int]:
        """Requests each worker's persistent batch holds (rank 1 first)."""
        self._send((ROWS, None))
        held = all_gather_values(self.ranks.control, [len(self.runner.input_batch.row_of)])
        return [int(rows) for rows, in held[1:]]

    def stage_seconds(self, reset: bool = False) -> list[tuple[float, float]]:
        """Each rank's (busy, waiting for activations) seconds in its pipeline stage since
        the last reset (rank order); `reset` starts them again."""
        self._send((TIMING, reset))
        stage = self.stage
        times = all_gather_values(self.ranks.control, [stage.busy_seconds, stage.wait_seconds])
        if reset:
            stage.reset_timing()
        return [(busy, wait) for busy, wait in times]

    def _send(self, message: Any, workers: range | None = None) -> None:
        """To every worker (or `workers`), queued: a pipeline's stages may be busy with
        earlier steps, and each reads it when it gets there."""
        if self.failure is not None:
            raise RuntimeError(f"tensor-parallel group is down: {self.failure}")
        try:
            broadcast_object(self.ranks.channels, workers or range(1, self.ranks.world_size),
                             message)
        except Exception as exc:
            self.step_failed(exc)
            raise RuntimeError(f"tensor-parallel group is down: {self.failure}") from None

    def step_failed(self, error: BaseException) -> None:
        """A step raised: under tensor parallelism the group cannot be trusted after a
        failed collective, so the engine is down for good; `failure` names the dead rank
        where one is found."""
        if self.failure is None:
            self.failure = self._dead_worker() or (
                f"a tensor-parallel collective failed: {str(error).splitlines()[0][:300]}")
            logger.error("%s; the engine is unavailable", self.failure)

    def _dead_worker(self) -> str | None:
        """Which worker is gone, if this executor can tell."""
        return None

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.failure is None:
            try:
                self._send((STOP, None))
                self.ranks.channels.flush()
            except Exception:  # noqa: BLE001 - the workers are gone already
                pass
        self.ranks.channels.close()


class MultiprocExecutor(TensorParallelExecutor):
    """Workers spawned on this machine; see the module docstring."""

    def __init__(self, size: int, device: torch.device, num_threads: int | None,
                 pipeline_size: int = 1) -> None:
        host, port = "127.0.0.1", free_port()
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(target=run_worker, name=f"llmserve-tp{rank}", daemon=True,
                            args=(rank, size, host, port, str(device), num_threads,
                                  pipeline_size))
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        logger.info("tensor parallel: %d worker processes started (pids %s)", size - 1,
                    ", ".join(str(p.pid) for p in self.processes))
        super().__init__(self._meet_workers(size, host, port, device, pipeline_size))
        self._watch = threading.Thread(target=self._watch_workers, daemon=True,
                                       name="llmserve-tp-watch")
        self._watch.start()

    def _meet_workers(self, size: int, host: str, port: int, device: torch.device,
                      pipeline_size: int) -> Ranks:
        """`connect`, failing at once (not after the connect timeout) if a worker dies
        before it joins."""
        met: list[Ranks] = []
        errors: list[BaseException] = []

        def meet() -> None:
            try:
                met.append(connect(0, size, host, port, device, pipeline_size))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)

        thread = threading.Thread(target=meet, daemon=True, name="llmserve-tp-connect")
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self._dead_worker()
            if dead is not None and thread.is_alive():
                raise RuntimeError(f"{dead} during start-up (its error is in the log above)")
        if errors:
            raise errors[0]
        return met[0]

    def _dead_worker(self, wait_s: float = 1.0) -> str | None:
        """The first worker found dead, named with its exit code; waits up to `wait_s` for
        one (a failed collective is usually a worker dying a moment earlier)."""
        deadline = time.monotonic() + wait_s
        while True:
            for process in self.processes:
                if not process.is_alive():
                    process.join(1.0)  # reaped: its exit code is known
                    return (f"tensor-parallel worker {process.name} (pid {process.pid}) "
                            f"exited with code {process.exitcode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        while not self._stopped:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            if ready and not self._stopped:
                found = self._dead_worker(wait_s=0.0)
                # a name beats the generic message of a collective that failed first
                if self.failure is None or not self.failure.startswith("tensor-parallel "
                                                                       "worker"):
                    self.failure = found
                logger.error("%s; the engine is unavailable", self.failure)
                return

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join(timeout)
            if process.is_alive():
                process.kill()


class ExternalExecutor(TensorParallelExecutor):
    """Rank 0 of ranks started by torchrun (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
    on this machine or others: a rank that goes away fails the step in flight (503) and
    the server exits, for torchrun or an orchestrator to start the ranks again."""

    exits_on_failure = True

    def __init__(self, size: int, device: torch.device, pipeline_size: int = 1) -> None:
        rank, world, host, port = torchrun_env()
        if rank != 0:
            raise RuntimeError("only RANK 0 runs the engine; the CLI runs the other ranks as "
                               "workers")
        if world != size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size is {size} but "
                             f"torchrun started {world} processes (WORLD_SIZE)")
        super().__init__(connect(0, size, host, port + 1, device, pipeline_size))
