"""The routing policy on its own: prefix keys, rendezvous hashing, the overflow rule."""

import pytest

from llmserve.router.policy import (
    PrefixAffinityPolicy,
    ReplicaLoad,
    overflows,
    prefix_key,
    rendezvous_score,
)

SHARED = "You are a careful assistant who answers in one sentence. " * 6  # > 256 chars


def idle(*indices: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, 0) for i in indices]


def completion(prompt: object, **extra: object) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **extra}


def chat(*contents: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def test_key_is_a_stable_hash_not_pythons_hash():
    # a fixed value: Python's hash() of a str changes from one process to the next
    assert prefix_key(completion("hello"), 256).hex() == "32d114b28c0a68f411178fe8a06d96f4"
    assert rendezvous_score(bytes(16), ReplicaLoad(1, 0).hashed) == 8748400299831792330


def test_key_reads_only_the_prefix():
    k = len(SHARED)
    assert prefix_key(completion(SHARED + "first"), k) == prefix_key(completion(SHARED + "2"), k)
    assert prefix_key(completion(SHARED + "x"), k + 1) != prefix_key(completion(SHARED + "y"),
                                                                     k + 1)
    # what is not the prompt does not matter, the cache salt does
    assert prefix_key(completion("a", temperature=1), 8) == prefix_key(completion("a"), 8)
    assert prefix_key(completion("a", cache_salt="s"), 8) != prefix_key(completion("a"), 8)


def test_key_of_token_ids_batches_and_chat():
    ids = list(range(300))
    assert prefix_key(completion(ids), 256) == prefix_key(completion(ids[:256] + [7]), 256)
    assert prefix_key(completion(ids), 256) != prefix_key(completion([1, *ids]), 256)
    assert prefix_key(completion([SHARED, "b"]), 256) == prefix_key(completion(SHARED), 256)
    assert prefix_key(completion([ids]), 256) == prefix_key(completion(ids), 256)
    # chat: roles and contents as JSON, so a shared first turn is a shared key
    assert prefix_key(chat(SHARED, "one"), 256) == prefix_key(chat(SHARED + "two"), 256)
    assert prefix_key(chat("short", "one"), 256) != prefix_key(chat("short", "two"), 256)
    assert prefix_key(chat(SHARED), 256) != prefix_key(completion(SHARED), 256)
    assert prefix_key(None, 256) == prefix_key(None, 256)  # a body that is not JSON


def test_same_prefix_goes_to_the_same_replica_and_prefixes_spread():
    policy = PrefixAffinityPolicy(prefix_chars=64)
    replicas = idle(0, 1, 2)
    chosen = {policy.choose("/v1/completions", completion(SHARED + s), replicas).replica
              for s in ("a", "b", "c", "d")}
    assert len(chosen) == 1
    # a fresh policy (another router process) agrees
    again = PrefixAffinityPolicy(prefix_chars=64).choose("/v1/completions",
                                                         completion(SHARED), replicas)
    assert chosen == {again.replica}
    counts = [0, 0, 0]
    for i in range(300):
        counts[policy.choose("/v1/completions", completion(f"topic {i}: "), replicas).replica] += 1
    assert min(counts) > 60, counts  # 100 each on average


def test_affinity_hit_after_first_request():
    policy = PrefixAffinityPolicy()
    results = [policy.choose("/v1/chat/completions", chat(SHARED, s), idle(0, 1)).affinity
               for s in ("a", "b", "c")]
    assert results == ["miss", "hit", "hit"]


@pytest.mark.parametrize(("affinity", "least", "spills"), [
    (0, 0, False), (2, 0, False), (3, 0, True),  # floor: up to 2 in flight never spill
    (3, 1, False), (4, 1, True),                 # above 2 x least + 1
    (5, 2, False), (6, 2, True), (9, 4, False), (10, 4, True),
])
def test_overflow_rule(affinity, least, spills):
    assert overflows(affinity, least) is spills


def test_overflow_goes_to_the_least_loaded_replica():
    policy = PrefixAffinityPolicy()
    target = policy.choose("/v1/completions", completion(SHARED), idle(0, 1, 2)).replica
    others = [i for i in range(3) if i != target]
    loads = {target: 3, others[0]: 1, others[1]: 0}
    replicas = [ReplicaLoad(i, loads[i]) for i in range(3)]
    route = policy.choose("/v1/completions", completion(SHARED), replicas)
    assert (route.replica, route.affinity) == (others[1], "overflow")
    loads[target] = 2  # at the floor: stays
    replicas = [ReplicaLoad(i, loads[i]) for i in range(3)]
    assert policy.choose("/v1/completions", completion(SHARED), replicas).replica == target


def test_a_down_replica_is_skipped_and_only_its_keys_move():
    policy = PrefixAffinityPolicy()
    prompts = [completion(f"document {i}") for i in range(60)]
    before = [policy.choose("/v1/completions", p, idle(0, 1, 2)).replica for p in prompts]
    after = [policy.choose("/v1/completions", p, idle(0, 2)).replica for p in prompts]
    assert 1 in before and 1 not in after
    assert all(a == b for a, b in zip(after, before, strict=True) if b != 1)


def test_prefix_chars_must_be_positive():
    with pytest.raises(ValueError, match="prefix_chars"):
        PrefixAffinityPolicy(prefix_chars=0)


def test_ray_serves_request_router_ranks_by_the_same_policy():
    """Ray Serve's router (`ray_routing.py`) ranks replicas named by their Ray ids: a
    prefix goes to the same replica whatever order Ray lists them in, and from a fresh
    router (another process); the rest follow least loaded first; overflow as the policy
    says; a request without a JSON body goes by load alone."""
    from types import SimpleNamespace

    from llmserve.router.ray_routing import forwarded_body, rank_replicas
    from llmserve.router.ray_serve import ForwardedRequest

    names = ["a1b2", "c3d4", "e5f6"]

    def ranked(body, loads, order=(0, 1, 2), policy=None):
        replicas = [ReplicaLoad(i, loads[names[j]], names[j]) for i, j in enumerate(order)]
        ranks = rank_replicas(policy or PrefixAffinityPolicy(), body, replicas)
        return [names[order[i]] for i in ranks]

    idle_loads = dict.fromkeys(names, 0)
    first = ranked(completion(SHARED + "a"), idle_loads)
    assert sorted(first) == names
    assert ranked(completion(SHARED + "b"), idle_loads, order=(2, 0, 1))[0] == first[0]
    busy = {**idle_loads, first[0]: 3, first[1]: 1}
    assert ranked(completion(SHARED), busy)[0] == first[2]  # overflow to the idlest
    assert ranked(None, {"a1b2": 2, "c3d4": 0, "e5f6": 1}) == ["c3d4", "e5f6", "a1b2"]
    forwarded = ForwardedRequest("POST", "/v1/completions", "", [], b"{}", completion("x"))
    pending = SimpleNamespace(args=[forwarded], kwargs={})
    assert forwarded_body(pending) == completion("x") and forwarded_body(None) is None
