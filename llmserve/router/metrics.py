"""The router's /metrics: every backend's metrics, labelled by backend, and its own.

Backend metrics are parsed from each backend's Prometheus text and re-emitted with one more
label naming the backend (`replica="i"` behind a data-parallel router, `role="prefill"` or
`role="decode"` behind a disaggregated one), samples of the same family from all backends
together (the exposition format wants one block per family). The router's own metrics,
defined here once, live in their own registry.
"""

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmserve.metrics import LATENCY_BUCKETS
from llmserve.router.replicas import Replica

AFFINITY_RESULTS = ("hit", "miss", "overflow")
SPLIT_PATHS = ("split", "direct")


class RouterMetrics:
    """Requests, failures, health and requests in flight per backend, each series labelled
    `label` (its value: `Replica.label`)."""

    def __init__(self, label: str, backends: Sequence[str]) -> None:
        self.label = label
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmserve_router_requests", "Requests sent to each backend.",
                                [label], registry=r)
        self.failures = Counter("llmserve_router_replica_failures",
                                "Requests answered 503 because their backend went down.",
                                [label], registry=r)
        self.replica_up = Gauge("llmserve_router_replica_up",
                                "1 while the backend passes its health checks.", [label],
                                registry=r)
        self.in_flight = Gauge("llmserve_router_requests_in_flight",
                               "Requests the router has in flight to each backend.",
                               [label], registry=r)
        for value in backends:  # every series shows from the start, at zero
            for family in (self.requests, self.failures):
                family.labels(value)

    def render(self, replicas: Sequence[Replica], texts: dict[str, str]) -> bytes:
        """The exposition text: each backend's metrics (from `texts`, by `Replica.label`)
        labelled `self.label`, then the router's own."""
        for replica in replicas:
            self.replica_up.labels(replica.label).set(int(replica.is_up))
            self.in_flight.labels(replica.label).set(replica.in_flight)
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Relabelled(texts, self.label))
        return generate_latest(merged) + generate_latest(self.registry)


class DataParallelMetrics(RouterMetrics):
    """Per replica (`replica="i"`), and how prefix affinity went."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__("replica", [str(i) for i in range(num_replicas)])
        self.affinity = Counter(
            "llmserve_router_affinity",
            "Routing decisions: hit (the prompt prefix went to this replica before), miss "
            "(it did not), overflow (sent to the least loaded replica instead).",
            ["result"], registry=self.registry)
        for result in AFFINITY_RESULTS:
            self.affinity.labels(result=result)


class DisaggregatedMetrics(RouterMetrics):
    """Per role (`role="prefill"`, `role="decode"`), how generation requests went (split in
    two hops, or direct to the decode server) and how long the prefill hop took."""

    def __init__(self) -> None:
        super().__init__("role", ["prefill", "decode"])
        self.split = Counter(
            "llmserve_router_disaggregated",
            "Generation requests: split (prefilled on the prefill server, decoded on the "
            "decode server) or direct (all on the decode server).", ["path"],
            registry=self.registry)
        self.prefill_seconds = Histogram(
            "llmserve_router_prefill_seconds",
            "Time of the prefill hop of split requests the prefill server answered 200.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        for path in SPLIT_PATHS:
            self.split.labels(path=path)


class ModelMetrics(RouterMetrics):
    """Per model (`model="x"`) behind a many-model server, and its loads and unloads."""

    def __init__(self) -> None:
        super().__init__("model", [])
        r = self.registry
        self.loaded = Gauge("llmserve_router_models_loaded", "Models loaded now.", registry=r)
        self.loads = Counter("llmserve_router_model_loads", "Models loaded (engine started).",
                             ["model"], registry=r)
        self.load_failures = Counter("llmserve_router_model_load_failures",
                                     "Loads whose engine exited or never served.", ["model"],
                                     registry=r)
        self.unloads = Counter(
            "llmserve_router_model_unloads",
            "Models unloaded, by reason: evicted (room for another), idle (keep-alive "
            "passed), request (by hand), exited (its process died).", ["model", "reason"],
            registry=r)
        self.load_seconds = Histogram("llmserve_router_model_load_seconds",
                                      "Time from starting a model's engine to its serving.",
                                      buckets=LATENCY_BUCKETS, registry=r)

    def forget(self, model: str) -> None:
        """Drop an unloaded model's per-backend gauges (its counters stay)."""
        for gauge in (self.replica_up, self.in_flight):
            try:
                gauge.remove(model)
            except KeyError:
                pass


class _Relabelled(Collector):
    def __init__(self, texts: dict[str, str], label: str) -> None:
        self.texts = texts
        self.label = label

    def collect(self) -> Iterator[Metric]:
        return iter(relabel(self.texts, self.label).values())


def relabel(texts: dict[str, str], label: str) -> dict[str, Metric]:
    """Metric families by name, each backend's samples (`texts`: its Prometheus text by
    label value) labelled `label="<value>"`."""
    families: dict[str, Metric] = {}
    for value, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, label: value}))
    return families
