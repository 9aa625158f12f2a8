"""What a draft token costs, measured on this machine at start-up.

Verifying k drafts makes a step compute k more tokens per request. Where the step is
bound by reading the weights (float32 at batch 1) that is nearly free; where it is bound
by arithmetic (the int4 kernels, larger batches) each extra token costs a good share of a
step. Measured on the default model, 2 cores: one extra token per request added 13 % to a
float32 batch-1 step, 30 % to an int4 one, 69 % to an int4 batch-4 one. So the cost is
measured, per batch size, on the engine's own model and kernels, rather than assumed:
`StepCosts.draft_token_cost(batch)` is the share of a plain step that one draft token per
request adds (its verification, plus the draft model's step that proposed it), and at
small batches `StepCosts.by_k` what each k adds: the exact path's float32 GEMM reads the
weights once for up to 48 rows, so there k drafts cost little more than their proposer's
steps, while each row the int4 GEMM adds costs integer work (`speculator.StepCosts`). A
proposer whose further drafts cost less than its first (an EAGLE head's native chain: one
pass with the Python around it, then passes inside one native call) says so with
`chain_step`.
"""

import statistics
import time
from collections.abc import Callable

import torch

from llmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from llmserve.layers.kv_cache import KVCache
from llmserve.spec_decode.speculator import StepCosts

CALIBRATION_BATCHES = (1, 2, 4, 8)
CALIBRATION_CONTEXT = 64  # tokens already cached per sequence while timing
# from this batch size on, k drafts per request are calibrated as a line through 0 and k
# = num_drafts (the GEMMs are past the rows a weight pass streams for)
BATCH_IN_LINE = 4
# rounds of the steps timed side by side (`time_steps`): the small batches, where every k
# is timed and the adaptive k follows each k's cost, take more (six calibrations in a row
# on a noisy 2-core Zen 3: the standard deviation of the 3-row step's ratio to the 1-row
# one 0.052 with 5 rounds, 0.018 with 9; of the 5-row one's, 0.065 and 0.038; the
# float32 engine with an EAGLE head ready in 5.8 s instead of 4.9)
ROUNDS, ROUNDS_EVERY_K = 5, 9


def measure_step_costs(model: torch.nn.Module, kv_cache: KVCache, attention: AttentionBackend,
                       num_drafts: int, draft_step: Callable[[int, int], float] | None = None,
                       batches: tuple[int, ...] = CALIBRATION_BATCHES,
                       chain_step: Callable[[int], float] | None = None) -> StepCosts:
    """Time plain steps and steps with `num_drafts` more tokens per sequence, per batch
    size; `draft_step(batch, repeats)` times one draft-model step, best of `repeats` (None:
    drafts cost nothing to propose, as prompt lookup), `chain_step(batch)` each draft after
    a chain's first (None: a draft step's). Writes only blocks no request holds yet (call
    before any request is admitted)."""
    by_batch, by_k, verify_by_k = {}, {}, {}
    for batch in batches:
        # every k where a few rows a weight pass still stream (a step's cost steps up
        # where they stop), the ends of the line beyond
        every_k = batch < BATCH_IN_LINE
        lengths = tuple(range(1, num_drafts + 2)) if every_k else (1, 1 + num_drafts)
        # a draft step is timed right after a plain step, each round, as the engine runs
        # it: after the target's weights have streamed through the caches (a head pass
        # timed hot, run after run, took 0.7 ms; right after the stream 1.5: session 43)
        drafts: list[float] = []
        after = None if draft_step is None else (lambda b=batch: draft_step(b, 1), drafts)
        times, ratios = time_steps(model, kv_cache, attention, batch, lengths,
                                   ROUNDS_EVERY_K if every_k else ROUNDS, with_ratios=True,
                                   after=after)
        plain = times[0]
        draft = min(drafts) / plain if draft_step is not None else 0.0
        further = chain_step(batch) / plain if chain_step is not None else draft
        extra, verifies, verify = [], [], 0.0
        for k, ratio in zip(range(1, num_drafts + 1) if every_k else (num_drafts,),
                            ratios[1:], strict=True):
            verify = max(verify, ratio - 1.0)  # more drafts never cost less
            verifies.append(verify)
            extra.append(verify + draft + (k - 1) * further)
        by_batch[batch] = extra[-1] / num_drafts
        if every_k:
            by_k[batch], verify_by_k[batch] = tuple(extra), tuple(verifies)
    return StepCosts(by_batch, by_k, verify_by_k)


def time_step(model: torch.nn.Module, kv_cache: KVCache, attention: AttentionBackend,
              batch: int, query_len: int, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of one forward (logits of every query token included) of
    `batch` sequences each computing `query_len` tokens after CALIBRATION_CONTEXT cached."""
    return time_steps(model, kv_cache, attention, batch, (query_len,), repeats)[0]


@torch.inference_mode()
def time_steps(model: torch.nn.Module, kv_cache: KVCache, attention: AttentionBackend,
               batch: int, query_lens: tuple[int, ...], repeats: int = 5,
               with_ratios: bool = False,
               after: tuple[Callable[[], float], list[float]] | None = None
               ) -> list[float] | tuple[list[float], list[float]]:
    """`time_step` for each of `query_lens`, timed in turn, one forward of each a round: a
    load that comes and goes on a busy machine then slows each about alike, where timing
    one length's repeats and then the other's let it land on one of them (a busy start-up
    measured a draft token at 1.2 steps at batch 2 and 0.09 at batch 4). `with_ratios`:
    also each length's time over the first's, the median over the rounds of the two
    timed side by side in a round: the best times of a noisy machine may come from
    different rounds (six calibrations in a row on a 2-core Zen 3 VM whose memory speed
    swung within seconds put the exact path's 7-token step at 1.06-1.32x a 1-token one
    by best times, 1.01-1.19x by the median ratio). `after` (a timer, a list): each round
    the timer runs right after the first length's step, its seconds going to the list."""
    block = kv_cache.block_size
    per_seq = -(-(CALIBRATION_CONTEXT + max(query_lens)) // block)
    if batch * per_seq > kv_cache.num_blocks:
        batch = max(1, kv_cache.num_blocks // per_seq)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    device = kv_cache.key[0].device
    prefill = AttentionMetadata.build([CALIBRATION_CONTEXT] * batch, [0] * batch, tables,
                                      block, device, attention)
    positions = torch.arange(CALIBRATION_CONTEXT, device=device).repeat(batch)
    ids = torch.randint(100, 1000, (batch * CALIBRATION_CONTEXT,), device=device)
    _logits(model, ids, positions, kv_cache, prefill)
    steps = []
    for query_len in query_lens:
        meta = AttentionMetadata.build([query_len] * batch, [CALIBRATION_CONTEXT] * batch,
                                       tables, block, device, attention)
        positions = torch.arange(CALIBRATION_CONTEXT, CALIBRATION_CONTEXT + query_len,
                                 device=device).repeat(batch)
        ids = torch.randint(100, 1000, (batch * query_len,), device=device)
        steps.append((ids, positions, meta))
    rounds = []
    for _ in range(repeats):
        seconds = []
        for i, (ids, positions, meta) in enumerate(steps):
            start = time.perf_counter()
            _logits(model, ids, positions, kv_cache, meta)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            if i == 0 and after is not None:
                after[1].append(after[0]())
        rounds.append(seconds)
    best = [min(column) for column in zip(*rounds, strict=True)]
    if not with_ratios:
        return best
    return best, [statistics.median(r[i] / r[0] for r in rounds) for i in range(len(steps))]


def _logits(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
            kv_cache: KVCache, meta: AttentionMetadata) -> None:
    """One forward and its logits; on a pipeline (every rank times the same steps) stage 0
    gets the final hidden states from the last stage, the others only run their layers."""
    hidden = model(ids, positions, kv_cache, meta)
    stage = getattr(model, "stage", None)
    if stage is not None:
        if not stage.is_first:
            return
        hidden = model.receive_final(len(ids))
    model.compute_logits(hidden)
