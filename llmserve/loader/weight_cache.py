"""Loaded models kept on disk in the kernels' layout, so that a warm start maps them.

Loading a quantized model costs more than reading it: a GGUF file's blocks are re-laid
for the kernels, float or 4-bit weights are quantized again, the vocabulary is parsed
(2.8 s for a 1B Q4_K_M file on a 2-core Zen 3, 1.9 s for the 135M default model). The
first load writes what it made (the model with its packed weights, the tokenizer, the
config): `store` pickles the object graph at once, each tensor in it by its index in a
list, and the tensors are written with `torch.save` once the engine is ready
(`write_queued`), on a thread of their own, while the server serves (writing a 1B model's
842 MiB took 0.7-1.8 s of its first start); a later start with the same request loads them
with `torch.load(mmap=True)`: the tensors are pages of that file, mapped, not copied, and
shared with the page cache and every other process serving the same model. The weights
are never written after loading, so the tensors written later are the ones loaded; the
graph, which the engine does change (adapters wrap layers), is the one loaded.

An entry answers one request (the model's files by path, size and modification time;
the quantization asked for; dtype, device, tensor-parallel rank) made by one build (the
package's Python sources, the kernel sources, torch's version, the CPU and its kernel
level). Where "auto" chose the format, the entry also names the cached decision it
followed and is used only while that decision stands (`llmserve bench kernels --retime`
that changes it, or a quiet start replacing it, means a fresh load). A choice a busy
machine made is not cached (kernel_choice.py) and neither is the model loaded under
it. An entry is a pickle the server wrote: it is read only where this user owns it, its
folder and the cache folder, and no other user may write to them (SECURITY.md). One
entry is kept per request (a newer one replaces it); an entry is not
written where it would leave less free than `MIN_FREE_FRACTION` of the disk or
`MIN_FREE_BYTES`, whichever is smaller (a large disk a tenth full is not short); one that
cannot be read is removed and the model loaded from its files. Only quantized models
on the CPU are kept (a float copy would be the checkpoint's size again and more).
`LLMSERVE_WEIGHT_CACHE=0` turns the cache off.
"""

import atexit
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.config.paths import cache_root
from llmserve.loader.catalog import ModelSource

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_WEIGHT_CACHE"
MIN_FREE_FRACTION = 0.10  # of the file system, left free after an entry is written ...
MIN_FREE_BYTES = 8 << 30  # ... or this much, where it is less
_FORMAT = 2  # what an entry holds; a change makes every older entry a miss
EXIT_WAIT_S = 30.0  # at exit, how long an unfinished write may still take


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    return cache_root() / "weights"


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    """The package's Python sources and the kernel sources, and torch's version: what
    decides the classes an entry holds and the layout of their packed weights."""
    from llmserve.kernels import build

    root = Path(__file__).resolve().parents[1]  # the package
    key = hashlib.sha256(f"{_FORMAT}\0{torch.__version__}\0".encode())
    for source in sorted(root.rglob("*.py")):
        key.update(str(source.relative_to(root)).encode() + b"\0" + source.read_bytes())
    key.update(build.sources_digest().encode())
    return key.hexdigest()


def _machine() -> str:
    """The CPU and the kernel level loaded now (a packed layout may be the level's)."""
    from llmserve import cpu_info
    from llmserve.kernels import level_of, native

    return "\0".join([cpu_info.cpu_model_name(), " ".join(sorted(cpu_info.cpu_features())),
                      level_of(native())])


def _source_files(source: ModelSource) -> list[Path]:
    if source.path.is_file():
        return [source.path]
    return sorted(p for p in source.path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Entry:
    key: str  # the request and the files and build it was made from
    request: str  # the request alone: a newer entry for it replaces the older
    source: ModelSource


def entry_for(source: ModelSource, quantization: str | None, dtype: torch.dtype,
              device: str | torch.device, rank: tuple[int, int]) -> Entry:
    """The entry for this request of `source`'s files as they are now."""
    request = json.dumps([source.kind, str(source.path.resolve()), source.name,
                          quantization, str(dtype), str(device), list(rank)])
    key = hashlib.sha256((_package_digest() + _machine() + request).encode())
    for path in _source_files(source):
        stat = path.stat()
        key.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return Entry(key.hexdigest()[:24], request, source)


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def load(entry: Entry, live: tuple = ()) -> dict[str, Any] | None:
    """The loaded parts kept for `entry` (what `store` was given), or None: none kept, the
    decision it followed changed, or the entry unreadable (then removed). `live`: this
    rank's `TensorParallel` and `PipelineStage` (their process groups are not kept: the
    parts get these in their place)."""
    if not enabled():
        return None
    key = entry.key
    meta_path, data_path = folder() / f"{key}.json", folder() / f"{key}.pt"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    decision = meta.get("decision")
    if decision is not None and _file_digest(Path(decision["file"])) != decision["sha256"]:
        logger.info("the kept %s was loaded under another kernel decision: loading it "
                    "again", meta.get("source"))
        return None
    if (unsafe := _unsafe(data_path)) is not None:
        logger.warning("not reading the kept weights %s: %s", data_path, unsafe)
        return None
    start = time.perf_counter()
    try:
        stored = torch.load(data_path, mmap=True, weights_only=True)
        # the graph was pickled by this package: read only from this user's own folder
        # (`_unsafe`), trusted as the kernel library it loads from beside it is (SECURITY.md)
        parts = _GraphUnpickler(io.BytesIO(stored["graph"].numpy().tobytes()),
                                stored["tensors"], live).load()
    except Exception as exc:  # noqa: BLE001 - a damaged entry: load from the files
        logger.warning("cannot read the kept weights %s (%s): loading from the model's "
                       "files", data_path, exc)
        _remove(key)
        return None
    logger.info("weights mapped from the cache in %.2f s (%s, %d MiB)",
                time.perf_counter() - start, data_path.name, data_path.stat().st_size >> 20)
    return parts


def _unsafe(path: Path) -> str | None:
    """Why an entry must not be read (None: it may): it, its folder or the cache folder
    above is not this user's, or any user may write to it (group write is left to the
    user's group, as a umask of 002 makes every folder). An entry is a pickle: whoever can
    write one runs code in the server, as whoever can write the kernel library beside it."""
    for item in (path, path.parent, path.parent.parent):
        try:
            info = item.stat()
        except OSError as exc:
            return f"cannot check {item}: {exc}"
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return f"{item} belongs to another user"
        if info.st_mode & 0o002:
            return f"others may write to {item}"
    return None


def _rank_kinds() -> tuple[type, ...]:
    """The objects of a rank's place among others (with live process groups): kept as
    their kind's name, replaced by the loading rank's own."""
    from llmserve.distributed.parallel import TensorParallel
    from llmserve.distributed.pipeline import PipelineStage

    return TensorParallel, PipelineStage


class _GraphPickler(pickle.Pickler):
    """Pickles an object graph with each tensor in it replaced by its index in `tensors`,
    and a rank's `TensorParallel` and `PipelineStage` by their kind's name."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self._index: dict[int, int] = {}
        self._ranks = _rank_kinds()

    def persistent_id(self, obj: Any) -> int | str | None:
        if isinstance(obj, self._ranks) and obj.size > 1:  # (size 1: no group, kept)
            return type(obj).__name__
        if not isinstance(obj, torch.Tensor):
            return None
        if (index := self._index.get(id(obj))) is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


class _GraphUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor], live: tuple = ()
                 ) -> None:
        super().__init__(file)
        self.tensors = tensors
        self.live = {type(obj).__name__: obj for obj in live if obj is not None}

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, str):
            if pid not in self.live:
                raise ValueError(f"the kept weights need this rank's {pid}")
            return self.live[pid]
        return self.tensors[pid]


@dataclass
class _Write:
    entry: Entry
    decision: dict | None
    graph: bytes
    tensors: list[torch.Tensor] = field(repr=False)


_queued: list[_Write] = []
_writers: list[threading.Thread] = []
_ready = False  # an engine is ready: writes start at once
_lock = threading.Lock()


def store(entry: Entry, parts: dict[str, Any], decision_file: Path | None) -> None:
    """Keep `parts` (the model and what goes with it) for `entry`; `decision_file`: the
    cached kernel decision they were loaded under, if "auto" chose. The object graph is
    pickled now; the tensors are written once an engine is ready (`write_queued`), or at
    exit. Replaces the request's earlier entries; skipped (and logged) where the disk is
    short or the parts cannot be written."""
    if not enabled():
        return
    decision = None
    if decision_file is not None:
        if (sha := _file_digest(decision_file)) is None:
            return  # the decision was not cached (a read-only cache): nothing to follow
        decision = {"file": str(decision_file), "sha256": sha}
    graph, tensors = io.BytesIO(), []
    try:
        _GraphPickler(graph, tensors).dump(parts)
    except Exception as exc:  # noqa: BLE001 - an object that cannot be pickled
        logger.warning("cannot keep the packed weights: %s", exc)
        return
    with _lock:
        _queued.append(_Write(entry, decision, graph.getvalue(), tensors))
        if _ready:
            _start_writer()


def write_queued() -> None:
    """An engine is ready (its timings done): write the queued entries, and any stored
    from now on, on a background thread."""
    global _ready
    with _lock:
        _ready = True
        _start_writer()


def flush(timeout_s: float | None = None) -> bool:
    """Wait for the entries queued so far to be written (those not yet started, here);
    False if a write still runs after `timeout_s`."""
    with _lock:
        writers, pending = list(_writers), list(_queued)
        _queued.clear()
    for write in pending:
        _write(write)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for writer in writers:
        writer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(writer.is_alive() for writer in writers)


def _start_writer() -> None:
    # under _lock
    if not _queued:
        return
    pending = list(_queued)
    _queued.clear()
    if not _writers:
        atexit.register(_at_exit)
    writer = threading.Thread(target=_write_all, args=(pending,), daemon=True,
                              name="llmserve-weight-cache")
    _writers.append(writer)
    writer.start()


def _write_all(pending: list[_Write]) -> None:
    try:  # this thread at the lowest priority (Linux: a thread's own nice value)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    for write in pending:
        _write(write)


def _at_exit() -> None:
    if not flush(EXIT_WAIT_S):
        logger.warning("exiting while the packed weights are still being written: not kept")


def _write(write: _Write) -> None:
    key, source = write.entry.key, write.entry.source
    target = folder()
    start = time.perf_counter()
    try:
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        _sweep(target)
        tmp = target / f"{key}.{os.getpid()}.tmp"
        graph = torch.frombuffer(bytearray(write.graph), dtype=torch.uint8)
        _save({"graph": graph, "tensors": write.tensors}, tmp)
        tmp.chmod(0o644)
        size = tmp.stat().st_size
        if (short := _disk_short(target)) is not None:
            tmp.unlink()
            logger.info("not keeping the packed weights (%d MiB): %s", size >> 20, short)
            return
        for old in _entries_for(write.entry.request):
            if old != key:
                _remove(old)
        tmp.replace(target / f"{key}.pt")
        _write_json(target / f"{key}.json", {
            "request": write.entry.request, "source": str(source.path), "bytes": size,
            "decision": write.decision, "written": time.time()})
    except Exception as exc:  # noqa: BLE001 - pickling or disk: the server runs without it
        logger.warning("cannot keep the packed weights in %s: %s", target, exc)
        for leftover in target.glob(f"{key}.*.tmp"):
            leftover.unlink(missing_ok=True)
        return
    logger.info("kept the packed weights for the next start in %.2f s (%d MiB, %s)",
                time.perf_counter() - start, size >> 20, target)


def _disk_short(target: Path) -> str | None:
    """Why the disk holding `target` is too full to keep an entry already written to it,
    or None."""
    usage = shutil.disk_usage(target)
    floor = min(usage.total * MIN_FREE_FRACTION, MIN_FREE_BYTES)
    if usage.free >= floor:
        return None
    return f"{usage.free >> 20} MiB of the disk would be left free, under {int(floor) >> 20} MiB"


def _sweep(target: Path) -> None:
    """Remove the partial entries of processes that are gone (killed while writing)."""
    for leftover in target.glob("*.*.tmp"):
        try:
            pid = int(leftover.suffixes[-2].lstrip("."))
            os.kill(pid, 0)
        except ProcessLookupError:
            leftover.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            continue


def _save(parts: dict[str, Any], path: Path) -> None:
    # no CRC over the records (0.23 s of the 0.95 s a 1B Q4_K_M model took here): a mapped
    # load never checks it; an entry's key already names what made it
    from torch.utils.serialization import config

    crc = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save(parts, path)
    finally:
        config.save.compute_crc32 = crc


def _entries_for(request: str) -> list[str]:
    keys = []
    for meta_path in folder().glob("*.json"):
        try:
            if json.loads(meta_path.read_text()).get("request") == request:
                keys.append(meta_path.stem)
        except (OSError, ValueError):
            continue
    return keys


def _remove(key: str) -> None:
    # a process that mapped the entry keeps its pages: unlinking never truncates them
    for suffix in (".json", ".pt"):
        (folder() / f"{key}{suffix}").unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.jtmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
