"""A second tier for full KV blocks, behind the block pool: on local disk (`DiskBlockStore`,
`--kv-offload-dir`), or in host memory (`HostBlockStore`, pinned on CUDA).

Blocks are keyed by their chain hash (`core/kv_cache_manager.hash_block`: the tokens, all
before them, `cache_salt`) inside a namespace for the model and numerics that made them
(`layout.py`). The scheduler asks only whether a hash is here (`in`); the model runner
moves bytes:

    runner, after a step's forward:  save(cache, block ids, hashes)   the blocks that
        became full this step are copied out now (a memcpy) and written on the store's
        own thread, off the step's critical path
    runner, before a step's forward: load(cache, block ids, hashes)   the blocks a
        request found here are read into its fresh blocks, all of a step's at once;
        returns how many leading ones arrived intact (the rest are recomputed)

Several engines may share a folder (a data-parallel server's replicas, servers on one
machine): a block one of them wrote is found by the others, and each keeps the folder
within its own cap. A disk block is one file: a header (magic, namespace, block hash,
payload length, CRC-32) and the payload (K and V of every layer, then an int8 cache's
scales), written to a temporary name and renamed, so a reader sees a whole file or none.
The writer thread runs at idle priority, raised to normal while a caller waits on `flush`
(at shutdown: up to 10 s). The namespace folder keeps a manifest of its layout; a
restarted engine with the same layout indexes the files it finds (without reading them)
and checks each one when it is loaded: a file that is truncated, flipped, another
namespace's, another block's or of the wrong size is deleted and counted
(`TierStats.rejected`), never loaded.

The store never leaves its folder: no symlink is followed (a symlinked subfolder or block
file is skipped at start, refused when asked for, never written or deleted through), and a
filesystem error while scanning, reading or deleting (a read-only folder, a file vanishing
under another engine, an unreadable entry) is contained: the block is a miss, the error
counted, the request goes on. A folder that cannot be written (a read-only mount, its
permissions) makes the tier read-only, with a warning: its blocks are used, none added.
"""

import atexit
import errno
import json
import logging
import os
import stat
import struct
import threading
import time
import weakref
import zlib
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmserve.cpu_info import set_thread_priority
from llmserve.kv_tier.layout import TierLayout
from llmserve.layers.kv_cache import KVCache

logger = logging.getLogger(__name__)

MAGIC = b"LLMSKVB1"
HEADER = struct.Struct("<8s16s32sQI")  # magic, namespace, block hash, payload bytes, crc32
SUFFIX = ".kvb"
MANIFEST = "manifest.json"
# copies waiting for the writer at most; past it new blocks are not written (counted)
MAX_PENDING_BYTES = 256 * 2**20
FLUSH_AT_EXIT_S = 10.0


@dataclass
class TierStats:
    """Totals since start, for /metrics and the preemption cost model."""

    num_loaded: int = 0  # blocks read back into the cache
    num_saved: int = 0  # blocks written to the tier
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    copy_seconds: float = 0.0  # the engine thread's share of saving: copying blocks out
    write_cpu_seconds: float = 0.0  # the writer thread's CPU (checksums, system calls)
    evictions: int = 0  # blocks dropped to stay under the size cap
    dropped_writes: int = 0  # blocks not written: the writer was too far behind, or the
    # folder cannot be written (read-only)
    rejected: Counter = field(default_factory=Counter)  # blocks refused, by reason


class BlockStore(ABC):
    """A tier of full blocks of one layout (`layout.py`), at most `capacity_bytes` of them
    (the least recently used leave first).

    Contract: `save` and `load` run on the engine thread between forwards; `save` copies
    the blocks before it returns (the cache may reuse them at once) and never blocks on
    the medium; `load` writes only into `block_ids`. `in` is true from `save` on (a block
    still being written is served from its copy) until the block is evicted or found bad.
    """

    name: str  # the tier's label in metrics ("disk", "host")

    def __init__(self, layout: TierLayout, capacity_bytes: int) -> None:
        if capacity_bytes < layout.block_bytes:
            raise ValueError(f"the KV tier's size cap ({capacity_bytes} bytes) holds no block "
                             f"of {layout.block_bytes} bytes")
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @abstractmethod
    def __contains__(self, block_hash: bytes) -> bool: ...

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    def save(self, cache: KVCache, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Keep the blocks `block_ids` (full, their KV written) under `block_hashes`."""
        start = time.perf_counter()
        todo = [(b, h) for b, h in zip(block_ids, block_hashes, strict=True) if h not in self]
        if todo:
            rows = gather_blocks(cache, [b for b, _ in todo], self.layout)
            self._put([h for _, h in todo], rows)
        self.stats.copy_seconds += time.perf_counter() - start

    def load(self, cache: KVCache, block_ids: list[int], block_hashes: list[bytes]) -> int:
        """Write the blocks stored under `block_hashes` into `block_ids`, in order, up to the
        first one missing or bad; returns how many were written."""
        start = time.perf_counter()
        rows = torch.empty((len(block_ids), self.layout.block_bytes), dtype=torch.uint8)
        num_ok = 0
        for i, block_hash in enumerate(block_hashes):
            if not self._get(block_hash, rows[i]):
                break
            num_ok += 1
        if num_ok:
            scatter_blocks(cache, block_ids[:num_ok], rows[:num_ok], self.layout)
        self.stats.num_loaded += num_ok
        self.stats.bytes_read += num_ok * self.layout.block_bytes
        self.stats.read_seconds += time.perf_counter() - start
        return num_ok

    @abstractmethod
    def _put(self, block_hashes: list[bytes], rows: torch.Tensor) -> None:
        """Keep rows[i] (a block's payload, uint8) under block_hashes[i]."""

    @abstractmethod
    def _get(self, block_hash: bytes, row: torch.Tensor) -> bool:
        """Read the block's payload into `row`; False (and forget it) if missing or bad."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every saved block is on the medium; False on timeout."""
        return True

    def close(self) -> None:
        self.flush(FLUSH_AT_EXIT_S)


class HostBlockStore(BlockStore):
    """Blocks in host memory (page-locked when the cache is on CUDA, for fast copies back).
    On the CPU it only helps when the cache itself is capped smaller than the host."""

    name = "host"

    def __init__(self, layout: TierLayout, capacity_bytes: int, pin: bool = False) -> None:
        super().__init__(layout, capacity_bytes)
        self.pin = pin
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def _put(self, block_hashes: list[bytes], rows: torch.Tensor) -> None:
        limit = self.capacity_bytes // self.layout.block_bytes
        for block_hash, row in zip(block_hashes, rows, strict=True):
            kept = row.clone()
            self._blocks[block_hash] = kept.pin_memory() if self.pin else kept
            self.stats.num_saved += 1
            self.stats.bytes_written += row.numel()
        while len(self._blocks) > limit:
            self._blocks.popitem(last=False)
            self.stats.evictions += 1

    def _get(self, block_hash: bytes, row: torch.Tensor) -> bool:
        kept = self._blocks.get(block_hash)
        if kept is None:
            self.stats.rejected["missing"] += 1
            return False
        self._blocks.move_to_end(block_hash)
        row.copy_(kept)
        return True


class DiskBlockStore(BlockStore):
    """Blocks as files under `root/<namespace>/<hh>/<hash>.kvb`; see the module docstring."""

    name = "disk"

    def __init__(self, root: str | Path, layout: TierLayout, capacity_bytes: int) -> None:
        super().__init__(layout, capacity_bytes)
        self.root = Path(root).expanduser() / layout.namespace
        self._namespace = bytes.fromhex(layout.namespace)
        self._file_bytes = HEADER.size + layout.block_bytes
        self._lock = threading.Condition()
        self._files: OrderedDict[bytes, None] = OrderedDict()  # on disk, LRU first
        self._pending: dict[bytes, torch.Tensor] = {}  # saved, not yet written
        self._queue: list[bytes] = []
        self._writing: bytes | None = None
        self._closed = False
        self._started = threading.Event()  # the writer knows its thread id
        # the folder cannot be written (a read-only mount, its permissions): blocks are
        # still found and read, nothing is written or deleted
        self.read_only = False
        try:
            self._open()
        except OSError as exc:
            raise ValueError(f"kv_offload_dir {root}: cannot use it for the KV tier "
                             f"({exc})") from None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="llmserve-kv-tier-writer")
        self._thread.start()
        _OPEN_STORES.add(self)

    def __contains__(self, block_hash: bytes) -> bool:
        """Here, or written since by another engine on this folder (the replicas of a
        data-parallel server, servers on one machine): such a file joins the index."""
        with self._lock:
            if block_hash in self._pending or block_hash in self._files:
                return True
        if not _is_real_file(self._path(block_hash)):
            return False
        with self._lock:
            self._files[block_hash] = None
            self._evict_over_cap()
            return block_hash in self._files

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._files) + len(self._pending)

    # ---- start-up: the manifest and the files of a previous life -------------------------

    def _open(self) -> None:
        if not _is_real_dir(self.root):
            self.root.mkdir(parents=True, exist_ok=True)  # an error here: no tier at all
        manifest = self.root / MANIFEST
        ours = json.loads(self.layout.to_json())
        try:
            theirs = json.loads(manifest.read_text())
        except (OSError, ValueError):
            theirs = None
        self.read_only = not os.access(self.root, os.W_OK)
        found = self._scan()
        if theirs != ours:
            if found:  # no manifest, or another layout's: nothing here can be trusted
                logger.warning("KV tier %s: %d block files under a manifest that is not "
                               "this engine's; %s, not loaded", self.root, len(found),
                               "left alone" if self.read_only else "deleted")
                self.stats.rejected["manifest"] += len(found)
                for _, _, path in found:
                    self._unlink(path)
                found = []
            try:
                tmp = manifest.with_name(f"{MANIFEST}.tmp{os.getpid()}")
                tmp.write_text(json.dumps(ours, indent=1))
                os.replace(tmp, manifest)
            except OSError as exc:
                self._turn_read_only(exc)
        kept = []
        for mtime, block_hash, path in found:
            try:
                size = path.lstat().st_size
            except OSError:  # gone since the scan (another engine on the folder)
                continue
            if size != self._file_bytes:
                self.stats.rejected["size"] += 1
                self._unlink(path)
            else:
                kept.append((mtime, block_hash))
        for _, block_hash in sorted(kept):
            self._files[block_hash] = None
        self._evict_over_cap()
        logger.info("KV tier: %s, %d blocks of %d KiB from a previous run, cap %.1f GiB%s",
                    self.root, len(self._files), self.layout.block_bytes // 1024,
                    self.capacity_bytes / 2**30, " (read-only)" if self.read_only else "")
        others = [p for p in self._entries(self.root.parent)
                  if p != self.root and _is_real_dir(p) and (p / MANIFEST).is_file()]
        if others:  # another model, dtype, kernel level or release: never read from here
            logger.info("KV tier: %d other layouts' folders beside it, left alone; delete "
                        "those no server uses", len(others))

    def _scan(self) -> list[tuple[float, bytes, Path]]:
        """(mtime, hash, path) of each regular file named as a block; torn temporary files
        of an earlier life are deleted. Nothing is followed out of the folder: a symlinked
        subfolder or file is skipped (and counted), never entered, read or deleted through;
        an entry that cannot be read is skipped, not fatal."""
        found = []
        for sub in self._entries(self.root):
            if not _is_real_dir(sub):
                if sub.is_symlink():
                    self.stats.rejected["symlink"] += 1
                continue
            for path in self._entries(sub):
                name = path.name
                try:
                    block_hash = bytes.fromhex(name.removesuffix(SUFFIX))
                except ValueError:
                    block_hash = b""
                try:
                    info = path.lstat()
                except OSError:
                    self.stats.rejected["unreadable"] += 1
                    continue
                if stat.S_ISLNK(info.st_mode):
                    self.stats.rejected["symlink"] += 1
                elif not stat.S_ISREG(info.st_mode):
                    continue
                elif name.endswith(SUFFIX) and len(block_hash) == 32:
                    found.append((info.st_mtime, block_hash, path))
                elif ".tmp" in name:
                    self._unlink(path)
        return found

    def _entries(self, folder: Path) -> list[Path]:
        try:
            return list(folder.iterdir())
        except OSError:
            self.stats.rejected["unreadable"] += 1
            return []

    def _turn_read_only(self, error: OSError) -> None:
        """The folder cannot be written: from now on blocks are only read (a warning, once)."""
        if not self.read_only:
            logger.warning("KV tier %s: the folder cannot be written (%s); the tier is "
                           "read-only: blocks already there are used, none are added",
                           self.root, error)
        self.read_only = True

    def _unlink(self, path: Path) -> bool:
        """Delete a file of the folder (a symlink itself, never what it points to); an error
        (a read-only folder, a file gone under another engine) is counted and logged once,
        never raised: the tier works on as a cache that could not forget one file."""
        if self.read_only:
            self.stats.rejected["undeletable"] += 1
            return False
        try:
            path.unlink(missing_ok=True)
            return True
        except OSError as exc:
            if not self.stats.rejected["undeletable"]:
                logger.warning("KV tier: cannot delete %s (%s); left in place", path, exc)
            self.stats.rejected["undeletable"] += 1
            return False

    # ---- writes, on the writer thread ---------------------------------------------------

    def _put(self, block_hashes: list[bytes], rows: torch.Tensor) -> None:
        if self.read_only:
            self.stats.dropped_writes += len(block_hashes)
            return
        with self._lock:
            pending_bytes = len(self._pending) * self.layout.block_bytes
            for block_hash, row in zip(block_hashes, rows, strict=True):
                if block_hash in self._pending or block_hash in self._files:
                    continue
                if pending_bytes + row.numel() > min(MAX_PENDING_BYTES, self.capacity_bytes):
                    self.stats.dropped_writes += 1
                    continue
                self._pending[block_hash] = row
                self._queue.append(block_hash)
                pending_bytes += row.numel()
            self._lock.notify_all()

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        set_thread_priority(self._tid, "idle")
        self._started.set()
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return  # closed, and everything written
                block_hash = self._queue.pop(0)
                row = self._pending[block_hash]
                self._writing = block_hash
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self._write(block_hash, row)
                ok = True
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    self._turn_read_only(exc)
                elif not self.stats.dropped_writes:  # the first of many, maybe (disk full)
                    logger.warning("KV tier: writing a block failed: %s", exc)
                ok = False
            with self._lock:
                del self._pending[block_hash]
                self._writing = None
                if ok:
                    self._files[block_hash] = None
                    self.stats.num_saved += 1
                    self.stats.bytes_written += self._file_bytes
                    self.stats.write_seconds += time.perf_counter() - start
                    self.stats.write_cpu_seconds += time.thread_time() - cpu
                    self._evict_over_cap()
                else:
                    self.stats.dropped_writes += 1
                self._lock.notify_all()

    def _write(self, block_hash: bytes, row: torch.Tensor) -> None:
        payload = row.numpy()
        header = HEADER.pack(MAGIC, self._namespace, block_hash, payload.nbytes,
                             zlib.crc32(payload))
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        if not _is_real_dir(path.parent):  # a symlinked subfolder: never written through
            raise OSError(f"{path.parent} is not a folder of the tier")
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with tmp.open("wb") as f:
            f.write(header)
            f.write(payload.data)
        os.replace(tmp, path)  # readers see the whole file or none

    def _evict_over_cap(self) -> None:
        """Delete least recently used files past the cap (caller holds the lock)."""
        limit = self.capacity_bytes // self._file_bytes
        while len(self._files) > max(limit, 0):
            block_hash, _ = self._files.popitem(last=False)
            self._unlink(self._path(block_hash))
            self.stats.evictions += 1

    def close(self) -> None:
        """Write what is queued (for at most FLUSH_AT_EXIT_S) and stop the writer."""
        self.flush(FLUSH_AT_EXIT_S)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(FLUSH_AT_EXIT_S)
        _OPEN_STORES.discard(self)

    def flush(self, timeout: float | None = None) -> bool:
        """The writer runs at normal priority until the queue is written (the caller waits
        for it: nothing else is to run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._started.wait()
        set_thread_priority(self._tid, "normal")
        try:
            with self._lock:
                while self._queue or self._writing is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._lock.wait(left)
            return True
        finally:
            set_thread_priority(self._tid, "idle")

    # ---- reads, on the engine thread ----------------------------------------------------

    def _get(self, block_hash: bytes, row: torch.Tensor) -> bool:
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                row.copy_(pending)
                return True
        if block_hash not in self:
            self.stats.rejected["missing"] += 1
            return False
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        reason = self._read(block_hash, row)
        if reason is None:
            try:
                os.utime(self._path(block_hash))  # recently used, for the next start's order
            except OSError:
                pass
            return True
        logger.warning("KV tier: block %s refused (%s); it is recomputed",
                       block_hash.hex()[:16], reason)
        self.stats.rejected[reason] += 1
        with self._lock:
            self._files.pop(block_hash, None)
        if reason != "missing":
            self._delete(block_hash)
        return False

    def _read(self, block_hash: bytes, row: torch.Tensor) -> str | None:
        """Read and check one block file into `row`; None, or why it is refused."""
        payload = row.numpy()
        try:
            # never through a symlink: a link named as a block may point anywhere
            # nor waiting on a FIFO planted under a block's name (it reads as truncated)
            fd = os.open(self._path(block_hash), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                header = f.read(HEADER.size)
                if len(header) < HEADER.size:
                    return "truncated"
                magic, namespace, stored_hash, num_bytes, crc = HEADER.unpack(header)
                if magic != MAGIC:
                    return "corrupt"
                if namespace != self._namespace:
                    return "another layout"
                if stored_hash != block_hash:
                    return "another block"
                if num_bytes != payload.nbytes:
                    return "size"
                if f.readinto(payload.data) != payload.nbytes:
                    return "truncated"
                if f.read(1):
                    return "size"
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return "symlink" if exc.errno == errno.ELOOP else "unreadable"
        return None if zlib.crc32(payload) == crc else "checksum"

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    def _delete(self, block_hash: bytes) -> None:
        self._unlink(self._path(block_hash))


def _is_real_dir(path: Path) -> bool:
    """A folder itself, not a symlink to one (nor anything unreadable)."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _is_real_file(path: Path) -> bool:
    """A regular file itself, not a symlink to one (nor anything unreadable)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


# disk stores not closed yet: their queued blocks are written when the process exits
_OPEN_STORES: "weakref.WeakSet[DiskBlockStore]" = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        store.close()


def gather_blocks(cache: KVCache, block_ids: list[int], layout: TierLayout) -> torch.Tensor:
    """Copy blocks out of the cache: (n, block_bytes) uint8 on the host, row i block_ids[i]
    as `layout` lays a block out."""
    rows = torch.empty((len(block_ids), layout.block_bytes), dtype=torch.uint8,
                       pin_memory=cache.key[0].device.type == "cuda")
    cache.read_blocks(block_ids, *_layer_major(rows, layout))
    return rows


def scatter_blocks(cache: KVCache, block_ids: list[int], rows: torch.Tensor,
                   layout: TierLayout) -> None:
    """Write `rows` (as `gather_blocks` makes them) into the cache at `block_ids`."""
    cache.write_blocks(block_ids, *_layer_major(rows, layout))


def _layer_major(rows: torch.Tensor, layout: TierLayout
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, block_bytes) uint8 rows, each block's data then its scales, seen as the cache's
    (layers, 2, n, block_size, H_kv, D) data and (layers, 2, n, block_size, H_kv) scales."""
    data = rows[:, : layout.data_bytes].view(layout.torch_kv_dtype)
    data = data.unflatten(1, layout.data_shape).permute(1, 2, 0, 3, 4, 5)
    if layout.scales_shape is None:
        return data, None
    scales = rows[:, layout.data_bytes :].view(torch.float32)
    return data, scales.unflatten(1, layout.scales_shape).permute(1, 2, 0, 3, 4)
