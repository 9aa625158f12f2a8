"""The engine's one handle on the model: an `Executor` runs each step on the runner(s)."""

from abc import ABC, abstractmethod
from typing import Any

from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.worker.model_runner import ModelRunner


class Executor(ABC):
    """Runs the steps the scheduler plans on every rank's model runner.

    Contract: `execute_model(out)` runs `out` on every rank and returns the sampling
    rank's `ModelRunnerOutput` (`begin` and `finish` the same in two halves, up to
    `pipeline_depth` steps begun and not finished); the engine never touches a runner,
    and a runner never knows of other ranks. `failure` says why no step can run any more (None while
    healthy); `step_failed(error)` is told of a step that raised (an executor whose ranks
    cannot be trusted after that marks itself failed). `runner` is this process's runner
    (its KV cache and persistent batch, for inspection).
    """

    runner: ModelRunner
    failure: str | None = None
    # steps the engine keeps in flight at once (`begin` ... `finish`, in order): a
    # pipeline's stages, each busy with its own step
    pipeline_depth: int = 1
    # once `failure` is set the server exits (non-zero) after answering what was in
    # flight: ranks on other hosts, which an orchestrator restarts together
    exits_on_failure: bool = False

    @abstractmethod
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""

    def begin(self, out: SchedulerOutput) -> Any:
        """Start a step; `finish` (in the order begun) returns its output."""
        return out

    def finish(self, begun: Any) -> ModelRunnerOutput:
        return self.execute_model(begun)

    def calibrate(self, num_drafts: int) -> None:  # noqa: B027 - a default hook
        """Other ranks join the speculative decoding cost calibration this rank runs
        next (`spec_decode/cost.py`); nothing to do with one rank."""

    def step_failed(self, error: BaseException) -> None:  # noqa: B027 - a default hook
        """A step raised; one process goes on stepping."""

    def shutdown(self) -> None:  # noqa: B027 - a default hook
        """Stop the other ranks, if any."""


class UniProcExecutor(Executor):
    """One process, one runner: the whole model on this device."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(out)
