"""How a many-model server makes room for a model (`ModelRouter._make_room`), on slots set
by hand: no process is started. The least recently used idle model goes first while the
count or the memory budget would be passed; a busy model drains, a pinned one stays."""

import asyncio
import json

import pytest

from llmserve.router.multi_model import ModelServerSettings


def _router_with(tmp_path, names: list[str], **config):
    """A many-model router over `names` (folders with a config), every slot's state set by
    hand: no process is started."""
    from llmserve.router.base import RouterSettings
    from llmserve.router.multi_model import ModelRouter

    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForCausalLM"]}))
    settings = ModelServerSettings(tmp_path, (), cache_dir=tmp_path / "cache", **config)
    return ModelRouter(RouterSettings(), settings)


def _loaded_slot(router, name: str, resident: int, last_used: float, busy: bool = False):
    from llmserve.router.multi_model import LOADED
    from llmserve.router.replicas import Replica

    slot = router.slots[name]
    slot.state, slot.resident_bytes, slot.last_used = LOADED, resident, last_used
    slot.replica = Replica(0, "http://127.0.0.1:9", model=name)
    slot.replica.in_flight = int(busy)
    router.replicas.append(slot.replica)
    return slot


def test_room_is_made_least_recently_used_first_within_the_memory_budget(tmp_path):
    gib = 2**30
    router = _router_with(tmp_path, ["a", "b", "c", "d"], max_loaded=3, memory_budget=3 * gib)
    a = _loaded_slot(router, "a", gib, last_used=1.0)
    b = _loaded_slot(router, "b", gib, last_used=2.0)
    new = router.slots["d"]
    new.resident_bytes = int(1.5 * gib)  # as measured at its last load
    asyncio.run(router._make_room(new))
    # 1 + 1 + 1.5 GiB passes 3 GiB: the least recently used goes, the other stays
    assert (a.state, b.state) == ("unloaded", "loaded")
    assert router.replicas == [b.replica]
    text = router.metrics.render([], {}).decode()
    assert 'llmserve_router_model_unloads_total{model="a",reason="evicted"} 1.0' in text


def test_a_busy_or_pinned_model_is_never_unloaded_to_make_room(tmp_path):
    router = _router_with(tmp_path, ["a", "b", "c"], max_loaded=2, pinned=("a",),
                          capacity_wait_s=0.3)
    _loaded_slot(router, "a", 1, last_used=1.0)
    b = _loaded_slot(router, "b", 1, last_used=2.0, busy=True)
    with pytest.raises(Exception, match="'b' still has 1 requests in flight") as refused:
        asyncio.run(router._make_room(router.slots["c"]))
    assert refused.value.status == 503
    assert b.state == "loaded" and not b.draining  # left as it was
    b.replica.in_flight = 0
    asyncio.run(router._make_room(router.slots["c"]))
    assert b.state == "unloaded" and router.slots["a"].state == "loaded"
