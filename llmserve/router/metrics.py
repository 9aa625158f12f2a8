"""The router's /metrics: every replica's metrics, labelled `replica="i"`, and its own.

Replica metrics are parsed from each replica's Prometheus text and re-emitted, samples of
the same family from all replicas together (the exposition format wants one block per
family). The router's own metrics, defined here once, live in their own registry.
"""

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmserve.router.replicas import Replica

AFFINITY_RESULTS = ("hit", "miss", "overflow")


class RouterMetrics:
    """Requests per replica, affinity outcomes, replicas up, requests in flight."""

    def __init__(self, num_replicas: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmserve_router_requests", "Requests sent to each replica.",
                                ["replica"], registry=r)
        self.affinity = Counter(
            "llmserve_router_affinity",
            "Routing decisions: hit (the prompt prefix went to this replica before), miss "
            "(it did not), overflow (sent to the least loaded replica instead).",
            ["result"], registry=r)
        self.failures = Counter("llmserve_router_replica_failures",
                                "Requests answered 503 because their replica went down.",
                                ["replica"], registry=r)
        self.replica_up = Gauge("llmserve_router_replica_up",
                                "1 while the replica passes its health checks.", ["replica"],
                                registry=r)
        self.in_flight = Gauge("llmserve_router_requests_in_flight",
                               "Requests the router has in flight to each replica.",
                               ["replica"], registry=r)
        for i in range(num_replicas):  # every series shows from the start, at zero
            for family in (self.requests, self.failures):
                family.labels(replica=str(i))
        for result in AFFINITY_RESULTS:
            self.affinity.labels(result=result)

    def render(self, replicas: Sequence[Replica], replica_texts: dict[int, str]) -> bytes:
        """The exposition text: each replica's metrics (from `replica_texts`, by index)
        with a `replica` label, then the router's own."""
        for replica in replicas:
            self.replica_up.labels(replica=str(replica.index)).set(int(replica.is_up))
            self.in_flight.labels(replica=str(replica.index)).set(replica.in_flight)
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Relabelled(replica_texts))
        return generate_latest(merged) + generate_latest(self.registry)


class _Relabelled(Collector):
    def __init__(self, replica_texts: dict[int, str]) -> None:
        self.replica_texts = replica_texts

    def collect(self) -> Iterator[Metric]:
        return iter(relabel(self.replica_texts).values())


def relabel(replica_texts: dict[int, str]) -> dict[str, Metric]:
    """Metric families by name, with each replica's samples labelled `replica="i"`."""
    families: dict[str, Metric] = {}
    for index, text in sorted(replica_texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                labels = {**sample.labels, "replica": str(index)}
                merged.samples.append(sample._replace(labels=labels))
    return families
