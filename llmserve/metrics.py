"""Every Prometheus metric of the server, defined once, and the periodic stats log line.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `llmserve_time_to_first_token_
seconds`). Each server owns its own `CollectorRegistry`, so several servers can live in one
process (the tests start a few). `EngineMetrics` is fed by the engine thread: `observe()`
with each step's outputs, `update_state()` after every loop turn.
"""

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from llmserve.distributed.kv_transfer import TransferStats
    from llmserve.kv_tier.store import TierStats
    from llmserve.spec_decode.speculator import SpecDecodeStats

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
SPEEDUP_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 8.0, 17.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
LOG_INTERVAL_S = 10.0


@dataclass
class _RequestState:
    """What the metrics remember of a request between its outputs."""

    last_token_time: float | None = None
    num_generation_tokens: int = 0


class EngineMetrics:
    """The Prometheus metrics of one server. Thread-safe: prometheus_client locks itself."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, registry=r, buckets=buckets)

        self.ttft = histogram("llmserve_time_to_first_token_seconds",
                              "Time from the request's arrival to its first token.",
                              LATENCY_BUCKETS)
        self.itl = histogram("llmserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens.", LATENCY_BUCKETS)
        self.tpot = histogram("llmserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              LATENCY_BUCKETS)
        self.e2e = histogram("llmserve_e2e_request_latency_seconds",
                             "Time from arrival to the last token.", LATENCY_BUCKETS)
        self.queue_time = histogram("llmserve_request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        self.prefill_time = histogram("llmserve_request_prefill_time_seconds",
                                      "Time from first scheduling to the first token.",
                                      LATENCY_BUCKETS)
        self.prompt_len = histogram("llmserve_request_prompt_tokens",
                                    "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_len = histogram("llmserve_request_generation_tokens",
                                        "Generated tokens per request.", TOKEN_BUCKETS)
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prefilled prompt tokens.",
                                     registry=r)
        self.generation_tokens = Counter("llmserve_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.request_success = Counter("llmserve_request_success",
                                       "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.preemptions = Counter("llmserve_num_preemptions", "Preempted requests.",
                                   registry=r)
        self.prefix_queries = Counter("llmserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("llmserve_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.", registry=r)
        self.prefix_hits_by_tier = Counter(
            "llmserve_prefix_cache_hits_by_tier",
            "Prompt tokens whose KV came from the prefix cache, by tier (memory, disk, host).",
            ["tier"], registry=r)
        # the KV tier (kv_tier/; zero without one): full prompt blocks missed in memory and
        # looked up there, found or not; bytes moved; blocks dropped for the size cap, not
        # written (the writer too far behind), and refused when read (by why)
        self.tier_hits = Counter("llmserve_kv_tier_hits",
                                 "Prompt blocks missed in memory and found in the KV tier.",
                                 ["tier"], registry=r)
        self.tier_misses = Counter("llmserve_kv_tier_misses",
                                   "Prompt blocks missed in memory and in the KV tier.",
                                   ["tier"], registry=r)
        self.tier_bytes_read = Counter("llmserve_kv_tier_bytes_read",
                                       "KV bytes read back from the tier.", ["tier"], registry=r)
        self.tier_bytes_written = Counter("llmserve_kv_tier_bytes_written",
                                          "KV bytes written to the tier.", ["tier"], registry=r)
        self.tier_evictions = Counter("llmserve_kv_tier_evictions",
                                      "Blocks dropped from the tier to stay under its size cap.",
                                      ["tier"], registry=r)
        self.tier_dropped_writes = Counter(
            "llmserve_kv_tier_dropped_writes",
            "Blocks not written to the tier (its writer too far behind, or a write failed).",
            ["tier"], registry=r)
        self.tier_rejected = Counter("llmserve_kv_tier_rejected",
                                     "Tier blocks refused (missing, truncated, checksum, ...).",
                                     ["tier", "reason"], registry=r)
        self._tier_totals: dict[tuple, float] = {}
        self.running = Gauge("llmserve_num_requests_running", "Requests being run.", registry=r)
        self.waiting = Gauge("llmserve_num_requests_waiting", "Requests waiting to run.",
                             registry=r)
        self.kv_usage = Gauge("llmserve_kv_cache_usage_ratio",
                              "Fraction of KV-cache blocks in use (1 = full).", registry=r)
        # prompt tokens computed here: less than llmserve_prompt_tokens by prefix-cache hits
        # and, on a decode server, by the prompts whose KV came from a prefill server
        self.prefill_computed = Counter("llmserve_prefill_computed_tokens",
                                        "Prompt tokens this engine computed.", registry=r)
        # disaggregated prefill/decode (zero elsewhere): sent on a prefill server,
        # received on a decode server
        self.kv_transfers = Counter("llmserve_kv_transfer_requests",
                                    "Prompts whose KV blocks were transferred.", registry=r)
        self.kv_transfer_bytes = Counter("llmserve_kv_transfer_bytes",
                                         "KV bytes transferred.", registry=r)
        self.kv_transfer_seconds = Counter("llmserve_kv_transfer_seconds",
                                           "Time on the wire of the KV transfers.", registry=r)
        self.role_info = Gauge("llmserve_kv_role_info",
                               "1 for this server's role in disaggregated prefill/decode.",
                               ["role"], registry=r)
        # speculative decoding (zero while it is off)
        self.spec_drafts = Counter("llmserve_spec_decode_num_drafts",
                                   "Verification rounds with at least one draft token.",
                                   registry=r)
        self.spec_draft_tokens = Counter("llmserve_spec_decode_num_draft_tokens",
                                         "Draft tokens verified.", registry=r)
        self.spec_accepted_tokens = Counter("llmserve_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_position = Counter(
            "llmserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.", ["position"], registry=r)
        self.spec_acceptance_rate = Gauge("llmserve_spec_decode_acceptance_rate",
                                          "Accepted / verified draft tokens since start.",
                                          registry=r)
        self.spec_request_acceptance_length = histogram(
            "llmserve_spec_decode_request_mean_acceptance_length",
            "Per finished request with drafts: tokens a verification round emitted (its "
            "bonus token included), averaged over its rounds.", SPEEDUP_BUCKETS)
        self.tokens_per_decode_step = histogram(
            "llmserve_request_tokens_per_decode_step",
            "Per finished request: tokens after its first per step that gave it any "
            "(speculation's speed-up in target steps; 1 without it).", SPEEDUP_BUCKETS)
        self.spec_mean_accepted_length = Gauge(
            "llmserve_spec_decode_mean_accepted_length",
            "Tokens emitted per round with drafts (accepted drafts + 1) since start.",
            registry=r)
        self._spec_counts: tuple = (0, 0, 0, ())
        self._requests: dict[str, _RequestState] = {}
        self._engine_counts = (0, 0, 0)  # preemptions, prefix queries, prefix hits
        self._prefill_counts = (0, 0, 0, 0.0)  # computed prompt tokens, transfers, bytes, s
        self._log = _StatsLog(log_interval_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's metrics."""
        return generate_latest(self.registry)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Record one step's outputs (one per request that got tokens or finished).

        The outputs are deltas (`RequestOutputKind.DELTA`, as `AsyncEngine` asks of the
        engine): their token ids are the ones generated since the request's last output.
        """
        for output in outputs:
            if not isinstance(output.outputs, list):  # a pooling request's one output
                self._observe_pooled(output)
                continue
            state = self._requests.setdefault(output.request_id, _RequestState())
            m = output.metrics
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if m is not None and m.first_token_time is not None:
                if state.last_token_time is None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                    self._log.prompt_tokens += len(output.prompt_token_ids)
                elif num_new > 0:
                    self.itl.observe((m.last_token_time - state.last_token_time) / num_new)
                state.last_token_time = m.last_token_time
            if num_new > 0:
                self.generation_tokens.inc(num_new)
                self._log.generation_tokens += num_new
                state.num_generation_tokens += num_new
            if output.finished:
                self._finish(output, state)
                del self._requests[output.request_id]

    def _observe_pooled(self, output: Any) -> None:
        """A pooling request (`PoolingRequestOutput`): its prompt, and its latency."""
        self._requests.pop(output.request_id, None)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self._log.prompt_tokens += len(output.prompt_token_ids)
        self.request_success.labels(finished_reason="stop").inc()
        self.prompt_len.observe(len(output.prompt_token_ids))
        m = output.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m is not None and m.queue_time is not None:
            self.queue_time.observe(m.queue_time)

    def _finish(self, output: RequestOutput, state: _RequestState) -> None:
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self.request_success.labels(finished_reason=reason or "abort").inc()
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(state.num_generation_tokens)
        m = output.metrics
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.mean_acceptance_length is not None:
            self.spec_request_acceptance_length.observe(m.mean_acceptance_length)
        if m.tokens_per_decode_step is not None:
            self.tokens_per_decode_step.observe(m.tokens_per_decode_step)

    def update_state(self, num_running: int, num_waiting: int, kv_usage: float,
                     num_preemptions: int, prefix_queries: int, prefix_hits: int,
                     spec: "SpecDecodeStats | None" = None) -> None:
        """Set the gauges and advance the counters kept by the engine as running totals."""
        if spec is not None:
            self._update_spec(spec)
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        old = self._engine_counts
        self._engine_counts = (num_preemptions, prefix_queries, prefix_hits)
        deltas = [max(new - prev, 0) for new, prev in zip(self._engine_counts, old, strict=True)]
        self.preemptions.inc(deltas[0])
        self.prefix_queries.inc(deltas[1])
        self.prefix_hits.inc(deltas[2])
        self.prefix_hits_by_tier.labels(tier="memory").inc(deltas[2])
        self._log.prefix_queries += deltas[1]
        self._log.prefix_hits += deltas[2]
        self._log.maybe_log(num_running, num_waiting, kv_usage)


    def update_prefill(self, computed_tokens: int, transfers: "TransferStats | None") -> None:
        """Advance the computed-prefill and KV-transfer counters to the engine's totals."""
        counts = (computed_tokens, *((transfers.num_transfers, transfers.num_bytes,
                                      transfers.seconds) if transfers else (0, 0, 0.0)))
        old = self._prefill_counts
        self._prefill_counts = counts
        for counter, new, prev in zip((self.prefill_computed, self.kv_transfers,
                                       self.kv_transfer_bytes, self.kv_transfer_seconds),
                                      counts, old, strict=True):
            if new > prev:
                counter.inc(new - prev)

    def update_tier(self, tier: str, hits: int, misses: int, hit_tokens: int,
                    stats: "TierStats") -> None:
        """Advance the KV tier's counters to the engine's totals (`tier`: its name)."""
        totals = {
            (self.tier_hits, ()): hits, (self.tier_misses, ()): misses,
            (self.prefix_hits_by_tier, ()): hit_tokens,
            (self.tier_bytes_read, ()): stats.bytes_read,
            (self.tier_bytes_written, ()): stats.bytes_written,
            (self.tier_evictions, ()): stats.evictions,
            (self.tier_dropped_writes, ()): stats.dropped_writes,
            **{(self.tier_rejected, (reason,)): n for reason, n in stats.rejected.items()},
        }
        for (counter, labels), total in totals.items():
            key = (id(counter), *labels)
            delta = total - self._tier_totals.get(key, 0)
            child = counter.labels(tier, *labels)  # shown from the start, at 0
            if delta > 0:
                child.inc(delta)
            self._tier_totals[key] = total

    def set_role(self, role: str | None) -> None:
        """`llmserve_kv_role_info{role}` = 1 on a prefill or decode server."""
        if role is not None:
            self.role_info.labels(role=role).set(1)

    def _update_spec(self, spec: "SpecDecodeStats") -> None:
        counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                  tuple(spec.accepted_per_position))
        old = self._spec_counts
        if counts == old:
            return
        self._spec_counts = counts
        self.spec_drafts.inc(max(counts[0] - old[0], 0))
        self.spec_draft_tokens.inc(max(counts[1] - old[1], 0))
        self.spec_accepted_tokens.inc(max(counts[2] - old[2], 0))
        for j, n in enumerate(counts[3]):
            prev = old[3][j] if j < len(old[3]) else 0
            self.spec_accepted_per_position.labels(position=str(j)).inc(max(n - prev, 0))
        self.spec_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_accepted_length.set(spec.mean_accepted_length)


class _StatsLog:
    """One INFO line every `interval_s` while there is work: throughput and engine state."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.last = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = 0

    def maybe_log(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        now = time.monotonic()
        elapsed = now - self.last
        if elapsed < self.interval_s:
            return
        busy = num_running or num_waiting or self.prompt_tokens or self.generation_tokens
        if busy:
            hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
            logger.info(
                "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, "
                "running %d, waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
                self.prompt_tokens / elapsed, self.generation_tokens / elapsed,
                num_running, num_waiting, 100 * kv_usage, 100 * hit_rate,
            )
        self.last = now
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = 0
