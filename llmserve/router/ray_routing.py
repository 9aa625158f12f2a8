"""Ray Serve's request router for llmserve's replicas: prefix-cache affinity bounded by
load, the policy `llmserve router` routes by (`policy.PrefixAffinityPolicy`).

Ray Serve imports this module by name (`RequestRouterConfig.request_router_class`) in each
process that holds a handle to the replicas: the ingress deployment (`ray_serve.py`),
which reads a request's body and hands it on as a `ForwardedRequest`, so the router sees
the prompt. The key is a hash of the prompt's prefix, mapped by rendezvous hashing on the
replicas' ids (every router, in any process, sends a prefix to the same replica) and
overflowing to the least loaded replica when the affinity replica runs far ahead
(`policy.overflows`), loads from Ray's queue-length cache. The other replicas follow
as lower ranks, least loaded first: Ray sends to the first rank with room.
"""

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from llmserve.router.policy import DEFAULT_PREFIX_CHARS, PrefixAffinityPolicy, ReplicaLoad


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> None:
        self.policy = PrefixAffinityPolicy(prefix_chars)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = [ReplicaLoad(i, self.replica_queue_len_cache.get(r.replica_id) or 0,
                             r.replica_id.unique_id)
                 for i, r in enumerate(candidate_replicas)]
        return [[candidate_replicas[i]] for i in rank_replicas(
            self.policy, forwarded_body(pending_request), loads)]


def rank_replicas(policy: PrefixAffinityPolicy, body: object,
                  loads: list[ReplicaLoad]) -> list[int]:
    """The replicas' indices in order of preference: the policy's choice for `body`, then
    the rest least loaded first (no body: all by load)."""
    if body is None:
        return [r.index for r in sorted(loads, key=lambda r: (r.in_flight, r.index))]
    chosen = policy.choose("", body, loads).replica
    rest = sorted((r for r in loads if r.index != chosen), key=lambda r: (r.in_flight, r.index))
    return [chosen] + [r.index for r in rest]


def forwarded_body(pending_request: PendingRequest | None) -> object:
    """The JSON body of the `ForwardedRequest` a request carries (None: none)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        body = getattr(arg, "json_body", None)
        if body is not None:
            return body
    return None
