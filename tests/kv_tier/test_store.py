"""The KV tier's block stores: blocks come back bit for bit, a restarted store finds its
files, and a hostile folder (truncated, flipped, renamed or foreign files, another layout's
manifest) loads nothing wrong."""

import dataclasses
import json
import os
import zlib

import pytest
import torch

from llmserve.kv_tier import DiskBlockStore, HostBlockStore, TierLayout
from llmserve.kv_tier.store import HEADER, MANIFEST
from llmserve.layers.kv_cache import KVCache

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def layout(kv_dtype: str = "bfloat16", **changes) -> TierLayout:
    base = TierLayout(model="m" * 64, dtype="float32", quantization="int4",
                      kv_cache_dtype=kv_dtype, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS,
                      num_kv_heads=HEADS, head_dim=HEAD_DIM, isa="avx2", num_threads=2,
                      attention="native", code="c" * 32)
    return dataclasses.replace(base, **changes)


def random_cache(kv_dtype: torch.dtype, seed: int = 0) -> KVCache:
    cache = KVCache.allocate(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, kv_dtype)
    g = torch.Generator().manual_seed(seed)
    for t in [*cache.key, *cache.value, *(cache.key_scales or []), *(cache.value_scales or [])]:
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-128, 128, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return cache


def block(cache: KVCache, i: int) -> list[torch.Tensor]:
    parts = [*cache.key, *cache.value, *(cache.key_scales or []), *(cache.value_scales or [])]
    return [t[i].clone() for t in parts]


def same_block(a: KVCache, i: int, b: KVCache, j: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(block(a, i), block(b, j), strict=True))


HASHES = [bytes([i]) * 32 for i in range(6)]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("kind", ["disk", "host"])
def test_blocks_come_back_bit_for_bit(tmp_path, kind, kv_dtype):
    lay = layout(kv_dtype)
    src, dst = random_cache(lay.torch_kv_dtype, 1), random_cache(lay.torch_kv_dtype, 2)
    store = (DiskBlockStore(tmp_path, lay, 2**30) if kind == "disk"
             else HostBlockStore(lay, 2**30))
    store.save(src, [3, 7, 1], HASHES[:3])
    assert all(h in store for h in HASHES[:3]) and HASHES[3] not in store
    store.flush()
    assert store.load(dst, [0, 5, 9], HASHES[:3]) == 3
    for i, j in ((3, 0), (7, 5), (1, 9)):
        assert same_block(src, i, dst, j)
    # untouched blocks stay as they were
    assert same_block(dst, 2, random_cache(lay.torch_kv_dtype, 2), 2)
    assert store.stats.num_loaded == 3 and store.stats.bytes_read == 3 * lay.block_bytes


def test_a_block_being_written_is_served_from_its_copy(tmp_path):
    lay = layout()
    store = DiskBlockStore(tmp_path, lay, 2**30)
    src, dst = random_cache(torch.bfloat16, 1), random_cache(torch.bfloat16, 2)
    with store._lock:  # the writer cannot take it yet
        store.save(src, [4], HASHES[:1])
        assert HASHES[0] in store
        src.key[0][4].zero_()  # the cache reuses the block at once
    assert store.load(dst, [6], HASHES[:1]) == 1
    assert not torch.equal(dst.key[0][6], src.key[0][4])  # the copy, not the reused block
    assert torch.equal(dst.value[2][6], src.value[2][4])


def test_a_restarted_store_finds_its_blocks_and_loads_them(tmp_path):
    lay = layout()
    src = random_cache(torch.bfloat16, 1)
    first = DiskBlockStore(tmp_path, lay, 2**30)
    first.save(src, [0, 1, 2], HASHES[:3])
    first.close()
    second = DiskBlockStore(tmp_path, lay, 2**30)
    assert second.num_blocks == 3 and all(h in second for h in HASHES[:3])
    dst = random_cache(torch.bfloat16, 2)
    assert second.load(dst, [9, 10, 11], HASHES[:3]) == 3
    assert same_block(src, 2, dst, 11)


def files(store: DiskBlockStore) -> dict[bytes, os.PathLike]:
    return {bytes.fromhex(p.stem): p for p in store.root.rglob("*.kvb")}


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def saved_store(tmp_path, lay=None, n: int = 4):
    lay = lay or layout()
    src = random_cache(lay.torch_kv_dtype, 1)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    store.save(src, list(range(n)), HASHES[:n])
    store.close()
    return lay, src


def test_damaged_files_are_refused_counted_and_recomputed(tmp_path):
    lay, src = saved_store(tmp_path)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    paths = files(store)
    flip_byte(paths[HASHES[1]], HEADER.size + 100)  # a payload byte: the checksum fails
    dst = random_cache(torch.bfloat16, 2)
    before = block(dst, 6)
    assert store.load(dst, [5, 6, 7], HASHES[:3]) == 1  # stops at the bad one
    assert same_block(src, 0, dst, 5)
    assert all(torch.equal(x, y) for x, y in zip(block(dst, 6), before, strict=True))
    assert store.stats.rejected == {"checksum": 1}
    assert HASHES[1] not in store and not paths[HASHES[1]].exists()
    # each other kind of damage
    with paths[HASHES[2]].open("r+b") as f:
        f.truncate(HEADER.size + 10)
    flip_byte(paths[HASHES[3]], 0)  # the magic
    assert store.load(dst, [6], HASHES[2:3]) == 0
    assert store.load(dst, [6], HASHES[3:4]) == 0
    assert store.stats.rejected == {"checksum": 1, "truncated": 1, "corrupt": 1}


def test_renamed_and_foreign_block_files_are_refused(tmp_path):
    lay, _ = saved_store(tmp_path, n=2)
    other = layout(model="x" * 64)  # another model's namespace, same shapes
    saved_store(tmp_path, other, n=3)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    ours, theirs = files(store), files(DiskBlockStore(tmp_path, other, 2**30))
    # a block file under another block's name
    os.replace(ours[HASHES[0]], ours[HASHES[1]])
    # another namespace's file copied in under a name we know
    ours[HASHES[0]].write_bytes(theirs[HASHES[2]].read_bytes())
    dst = random_cache(torch.bfloat16, 2)
    assert store.load(dst, [5], HASHES[1:2]) == 0
    assert store.load(dst, [5], HASHES[0:1]) == 0
    assert store.stats.rejected == {"another block": 1, "another layout": 1}


def test_a_manifest_of_another_layout_makes_every_file_untrusted(tmp_path):
    lay, _ = saved_store(tmp_path)
    store_root = tmp_path / lay.namespace
    other = json.loads(layout(kv_dtype="float32").to_json())
    (store_root / MANIFEST).write_text(json.dumps(other))
    store = DiskBlockStore(tmp_path, lay, 2**30)
    assert store.num_blocks == 0 and not any(h in store for h in HASHES)
    assert store.stats.rejected == {"manifest": 4}
    assert json.loads((store_root / MANIFEST).read_text()) == json.loads(lay.to_json())


def test_files_without_a_manifest_and_torn_writes_are_dropped(tmp_path):
    lay, _ = saved_store(tmp_path)
    root = tmp_path / lay.namespace
    torn = next(root.rglob("*.kvb")).with_suffix(".kvb.tmp123")
    torn.write_bytes(b"partial")
    wrong_size = root / "ab" / ("ab" * 32 + ".kvb")
    wrong_size.parent.mkdir(exist_ok=True)
    wrong_size.write_bytes(b"x" * 10)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    assert store.num_blocks == 4 and not torn.exists() and not wrong_size.exists()
    assert store.stats.rejected == {"size": 1}
    (root / MANIFEST).unlink()
    store = DiskBlockStore(tmp_path, lay, 2**30)
    assert store.num_blocks == 0 and store.stats.rejected == {"manifest": 4}


def test_the_size_cap_evicts_least_recently_used_first(tmp_path):
    lay = layout()
    file_bytes = HEADER.size + lay.block_bytes
    store = DiskBlockStore(tmp_path, lay, 3 * file_bytes)
    src, dst = random_cache(torch.bfloat16, 1), random_cache(torch.bfloat16, 2)
    store.save(src, [0, 1, 2], HASHES[:3])
    store.flush()
    assert store.load(dst, [8], HASHES[:1]) == 1  # block 0 is now the most recent
    store.save(src, [3], HASHES[3:4])
    store.flush()
    assert [h in store for h in HASHES[:4]] == [True, False, True, True]
    assert store.stats.evictions == 1 and len(files(store)) == 3
    # a restart keeps the cap and the files' recency
    store.close()
    again = DiskBlockStore(tmp_path, lay, 2 * file_bytes)
    assert again.num_blocks == 2 and again.stats.evictions == 1


def test_host_store_keeps_its_cap(tmp_path):
    lay = layout()
    store = HostBlockStore(lay, 2 * lay.block_bytes)
    store.save(random_cache(torch.bfloat16), [0, 1, 2], HASHES[:3])
    assert [h in store for h in HASHES[:3]] == [False, True, True]
    assert store.stats.evictions == 1


def test_the_checksum_is_over_the_payload(tmp_path):
    lay, src = saved_store(tmp_path, n=1)
    path = next((tmp_path / lay.namespace).rglob("*.kvb"))
    data = path.read_bytes()
    magic, namespace, block_hash, num_bytes, crc = HEADER.unpack(data[: HEADER.size])
    assert (magic, namespace.hex(), block_hash, num_bytes) == (
        b"LLMSKVB1", lay.namespace, HASHES[0], lay.block_bytes)
    assert crc == zlib.crc32(data[HEADER.size :])


def test_a_cap_smaller_than_a_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        DiskBlockStore(tmp_path, layout(), 100)


def test_a_folder_it_cannot_write_is_refused_by_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="kv_offload_dir .*a-file"):
        DiskBlockStore(blocker / "tier", layout(), 2**30)


def test_close_writes_what_is_queued_and_stops_the_writer(tmp_path):
    lay = layout()
    store = DiskBlockStore(tmp_path, lay, 2**30)
    store.save(random_cache(torch.bfloat16), [0, 1], HASHES[:2])
    store.close()
    assert not store._thread.is_alive() and len(files(store)) == 2


def test_engines_sharing_a_folder_find_each_others_blocks(tmp_path):
    lay = layout()
    src, dst = random_cache(torch.bfloat16, 1), random_cache(torch.bfloat16, 2)
    first, second = DiskBlockStore(tmp_path, lay, 2**30), DiskBlockStore(tmp_path, lay, 2**30)
    first.save(src, [2, 3], HASHES[:2])
    first.flush()
    assert HASHES[0] in second and HASHES[2] not in second
    assert second.load(dst, [7, 8], HASHES[:2]) == 2
    assert same_block(src, 3, dst, 8)
    second.save(src, [2], HASHES[:1])  # already on disk: not written again
    second.flush()
    assert second.stats.num_saved == 0


def test_the_store_never_leaves_its_folder(tmp_path):
    """Symlinks planted in the tier (a subfolder pointing elsewhere, a block-named link to a
    valid block file outside, a dangling one, a loop) are never followed: start-up neither
    fails nor deletes or reads anything outside the folder, and a linked block is a miss."""
    lay, src = saved_store(tmp_path / "tier")
    outside = tmp_path / "outside"
    outside.mkdir()
    store_root = tmp_path / "tier" / lay.namespace
    paths = {h: p for h, p in ((bytes.fromhex(p.stem), p) for p in store_root.rglob("*.kvb"))}
    # what a scan that followed the link would delete: a torn-looking file, a wrong-size block
    bait = [outside / "notes.tmp1", outside / ("cd" * 32 + ".kvb")]
    for path in bait:
        path.write_bytes(b"precious")
    (store_root / "cd").symlink_to(outside, target_is_directory=True)
    # block 0's file moved outside, a link in its place; dangling and looping links
    moved = outside / "block0"
    os.replace(paths[HASHES[0]], moved)
    paths[HASHES[0]].symlink_to(moved)
    sub = paths[HASHES[1]].parent
    (sub / ("ee" * 32 + ".kvb")).symlink_to(tmp_path / "nowhere")
    loop = sub / ("ef" * 32 + ".kvb")
    loop.symlink_to(loop)
    store = DiskBlockStore(tmp_path / "tier", lay, 2**30)
    assert all(path.read_bytes() == b"precious" for path in bait) and moved.exists()
    assert store.stats.rejected["symlink"] == 4  # the folder link and the three file links
    assert HASHES[0] not in store and HASHES[1] in store
    dst = random_cache(lay.torch_kv_dtype, 2)
    assert store.load(dst, [5], HASHES[:1]) == 0  # the link is a miss, not a read
    assert store.load(dst, [6], HASHES[1:2]) == 1 and same_block(src, 1, dst, 6)
    # a block saved now whose subfolder is the planted link is not written through it
    store.save(src, [2], [bytes([0xCD]) * 32])
    store.close()
    assert sorted(p.name for p in outside.iterdir()) == sorted(["block0", *(p.name for p in bait)])


def test_a_file_it_cannot_delete_fails_no_request(tmp_path, monkeypatch):
    """A read-only folder (unlink raises): a damaged block is a miss, counted, and the load
    goes on without an exception for the step (it was a 500 for every request)."""
    from pathlib import Path

    lay, src = saved_store(tmp_path)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    flip_byte(files(store)[HASHES[1]], HEADER.size + 100)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    dst = random_cache(torch.bfloat16, 2)
    assert store.load(dst, [5, 6], HASHES[:2]) == 1
    assert store.load(dst, [7], HASHES[2:3]) == 1 and same_block(src, 2, dst, 7)
    assert store.stats.rejected == {"checksum": 1, "undeletable": 1}
    assert HASHES[1] not in store._files


def test_a_folder_that_turns_read_only_makes_the_tier_read_only(tmp_path, monkeypatch):
    """Writes failing with EROFS (the folder remounted read-only under a running server):
    the tier stops writing, with one warning, and still serves what it has."""
    import errno
    from pathlib import Path

    lay, src = saved_store(tmp_path)
    store = DiskBlockStore(tmp_path, lay, 2**30)
    real_open = Path.open

    def refuse(self, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    store.save(src, [3], [bytes([0xAA]) * 32])
    assert store.flush(30) and store.read_only
    store.save(src, [3], [bytes([0xAB]) * 32])  # not even queued
    assert store.stats.dropped_writes == 2 and store.stats.num_saved == 0
    dst = random_cache(torch.bfloat16, 2)
    assert store.load(dst, [4], HASHES[:1]) == 1 and same_block(src, 0, dst, 4)
    store.close()
