"""Which replica serves a request: prefix-cache affinity, bounded by load.

A `ReplicaPolicy` sees a request (its route and JSON body) and the load of the replicas
that are up, and picks one; the proxy does everything else, so another policy plugs in
without touching it. (Disaggregated prefill/decode is not a policy but a router mode of its
own: `disaggregated`.)

`PrefixAffinityPolicy` sends requests whose prompts start alike to the same replica, whose
prefix cache then already holds their shared blocks: the key is a hash of the prompt's first
`prefix_chars` characters (or token ids), mapped to a replica by rendezvous hashing, so a
replica going down moves only its own keys. Affinity yields to load when the affinity
replica runs far ahead of the least loaded one (`overflows`).
"""

import hashlib
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_PREFIX_CHARS = 256
# A replica with the prefix cached prefills only the suffix, so it may take up to about
# twice the work of the idlest replica before a request is better off elsewhere; below the
# floor a burst of one conversation's turns never scatters.
MIN_OVERFLOW_LOAD = 2
MAX_TRACKED_KEYS = 65536


@dataclass(frozen=True)
class ReplicaLoad:
    """What a policy sees of a replica that is up: its index and requests in flight, and
    what it is hashed by (its index unless it has a name of its own that every router
    sees alike: a Ray Serve replica's id)."""

    index: int
    in_flight: int
    identity: str | None = None

    @property
    def hashed(self) -> bytes:
        return self.index.to_bytes(4, "little") if self.identity is None \
            else self.identity.encode()


@dataclass(frozen=True)
class Route:
    """A policy's decision: the replica, and how affinity went ("hit": the key went to this
    replica before, "miss": it did not, "overflow": it left its affinity replica for load)."""

    replica: int
    affinity: str


class ReplicaPolicy(ABC):
    """Picks the replica for one request."""

    @abstractmethod
    def choose(self, route: str, body: Any, replicas: Sequence[ReplicaLoad]) -> Route:
        """The replica for a request to `route` with JSON `body` (None if the body is not
        JSON), among `replicas`, the ones that are up (never empty)."""


class PrefixAffinityPolicy(ReplicaPolicy):
    """Rendezvous hashing of the prompt's prefix, overflowing to the least loaded replica."""

    def __init__(self, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be at least 1, got {prefix_chars}")
        self.prefix_chars = prefix_chars
        self._last_replica: OrderedDict[bytes, int] = OrderedDict()  # key -> replica, LRU

    def choose(self, route: str, body: Any, replicas: Sequence[ReplicaLoad]) -> Route:
        key = prefix_key(body, self.prefix_chars)
        target = max(replicas, key=lambda r: rendezvous_score(key, r.hashed))
        least = min(replicas, key=lambda r: (r.in_flight, r.index))
        if overflows(target.in_flight, least.in_flight):
            return Route(least.index, "overflow")
        hit = self._last_replica.get(key) == target.index
        self._last_replica[key] = target.index
        self._last_replica.move_to_end(key)
        if len(self._last_replica) > MAX_TRACKED_KEYS:
            self._last_replica.popitem(last=False)
        return Route(target.index, "hit" if hit else "miss")


def overflows(affinity_in_flight: int, least_in_flight: int) -> bool:
    """Whether a request leaves its affinity replica for the least loaded one: when the
    affinity replica has more than max(2, 2 x least + 1) requests in flight."""
    return affinity_in_flight > max(MIN_OVERFLOW_LOAD, 2 * least_in_flight + 1)


def prefix_key(body: Any, prefix_chars: int) -> bytes:
    """A stable hash of the request's prompt prefix (and its `cache_salt`: requests with
    different salts never share cache blocks).

    Completions: the first `prefix_chars` characters of the prompt, or its first
    `prefix_chars` token ids (the first prompt of a batch). Chat: the first `prefix_chars`
    characters of the messages' roles and contents as JSON. Anything else (the body of
    /detokenize, a body that is not JSON): the whole body.
    """
    kind, text, salt = "other", json.dumps(body, sort_keys=True), None
    if isinstance(body, dict):
        salt = body.get("cache_salt")
        if isinstance(body.get("messages"), list):
            turns = [{"role": m.get("role"), "content": m.get("content")}
                     for m in body["messages"] if isinstance(m, dict)]
            kind, text = "chat", json.dumps(turns, ensure_ascii=False)[:prefix_chars]
        elif "prompt" in body:
            kind, text = _prompt_prefix(body["prompt"], prefix_chars)
    material = json.dumps([kind, salt, text], ensure_ascii=False).encode()
    return hashlib.blake2b(material, digest_size=16).digest()


def _prompt_prefix(prompt: Any, prefix_chars: int) -> tuple[str, str]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return "text", prompt[:prefix_chars]
    if isinstance(prompt, list):
        return "ids", json.dumps(prompt[:prefix_chars])
    return "other", json.dumps(prompt)


def rendezvous_score(key: bytes, replica: bytes) -> int:
    """Highest-random-weight hashing: a key goes to the replica with the highest score."""
    digest = hashlib.blake2b(key + replica, digest_size=8).digest()
    return int.from_bytes(digest, "little")
