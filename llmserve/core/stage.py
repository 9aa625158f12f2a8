"""Where features attach to a step without living in it: a `StepStage` is called by the
scheduler at the edges of each step, and what it adds travels in the `SchedulerOutput` as
data (draft tokens on the scheduled requests, the grammar bitmask rows).

    before_schedule(running, finished)   e.g. drafts cut to what their request can use
    schedule()                           the scheduler's own policy
    after_schedule(out, requests)        e.g. the grammar masks of the rows to sample,
                                         how many drafts to propose after sampling
    ... the forward, the sampling, the runner's drafts ...
    after_update(out, result)            e.g. the speculator counts accepted drafts and
                                         sets the new ones

A stage runs no model code: that is the runner's (drafts are proposed by the runner after
its forward, `worker/drafts.py`).
"""

from collections.abc import Mapping

from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.request import Request


class StepStage:
    """A feature's hooks at the scheduler's edges. Contract: a stage never changes which
    requests run or how many tokens each gets (that is the scheduler's policy); it may
    set `Request.spec_token_ids` (the scheduler trims them to the budget) and fill
    `SchedulerOutput` fields that are its own. Every hook defaults to doing nothing."""

    def before_schedule(self, running: list[Request], finished_ids: set[str]) -> None:
        """Before a step is scheduled; `finished_ids`: requests that ended since the
        last one (forget their state)."""

    def after_schedule(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The step is scheduled; `requests` holds each scheduled request by id."""

    def after_update(self, out: SchedulerOutput, result: ModelRunnerOutput,
                     requests: list[Request | None]) -> None:
        """The step's tokens were appended (its requests' counts are up to date);
        `requests[i]` is `out.scheduled[i]`'s request (None if it was aborted meanwhile;
        a request that finished in this step is there, freed)."""
