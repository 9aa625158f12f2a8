"""A loaded model kept on disk (loader/weight_cache.py): a start that maps it runs the same
bits as one that loads the files, and an entry is used only for what made it."""

import json
import logging
import shutil

import pytest
import torch

from llmserve.loader import weight_cache
from llmserve.loader.kernel_choice import KernelChoice
from llmserve.loader.model_loader import load_model
from tests.engine.test_default_path import _family_file
from tests.models.test_llama_reference import full_logits, per_op_logits

IDS = list(range(100, 140))
DISK_SHORT = weight_cache._disk_short  # the `cache` fixture's tests run whatever this disk holds


def load(*args, **kwargs):
    """`load_model`, then its entry written (a server writes it once its engine is ready,
    on a thread of its own)."""
    loaded = load_model(*args, **kwargs)
    assert weight_cache.flush(120)
    return loaded


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setenv(weight_cache.ENV, "1")
    monkeypatch.setattr(weight_cache, "folder", lambda: folder)
    monkeypatch.setattr(weight_cache, "_ready", False)  # no engine is: writes wait
    monkeypatch.setattr(weight_cache, "_disk_short", lambda target: None)
    return folder


@pytest.fixture
def loads(monkeypatch):
    """What each `weight_cache.load` returned: "hit" or "miss"."""
    seen: list[str] = []
    real = weight_cache.load

    def spy(entry, live=()):
        parts = real(entry, live)
        seen.append("miss" if parts is None else "hit")
        return parts

    monkeypatch.setattr(weight_cache, "load", spy)
    return seen


def _mapped(path) -> list[tuple[int, int]]:
    """This process's address ranges mapped from `path`."""
    with open("/proc/self/maps") as maps:
        return [tuple(int(a, 16) for a in line.split()[0].split("-"))
                for line in maps if line.rstrip().endswith(str(path))]


def _entries(folder) -> list:
    return sorted(folder.glob("*.pt")) if folder.exists() else []


# a K-quant mix and a mixture's experts in the default tier; an untied embedding on its own
# blocks (Phi-3) and Gemma 2's norms and soft-capping under -m slow
@pytest.mark.parametrize(("family", "qtype"), [
    ("llama", "Q4_K_M"), ("qwen3moe", "Q4_K_M"),
    pytest.param("phi3", "Q8_0", marks=pytest.mark.slow),
    pytest.param("gemma2", "Q4_K_M", marks=pytest.mark.slow)])
def test_a_kept_model_runs_the_bits_of_a_loaded_one(family, qtype, tmp_path, smollm2_gguf,
                                                    cache, loads):
    path = str(_family_file(family, qtype, tmp_path, smollm2_gguf))
    loaded = load(path, quantization="kquant")
    assert loads == ["miss"] and len(_entries(cache)) == 1
    kept = load(path, quantization="kquant")
    assert loads == ["miss", "hit"]
    assert kept.model is not loaded.model and kept.model.native_layers is not None
    assert kept.quantization == loaded.quantization == "kquant"
    # the kept weights are pages of the entry's file, not copies
    mapped = _mapped(_entries(cache)[0])
    assert all(any(lo <= b.data_ptr() < hi for lo, hi in mapped)
               for b in kept.model.buffers() if b.dtype == torch.uint8 and b.numel() > 4096)
    ours = full_logits(kept.model, IDS)
    assert torch.equal(ours, full_logits(loaded.model, IDS))
    assert torch.equal(ours, per_op_logits(kept.model, IDS))  # the one-call stack too
    assert kept.tokenizer.encode("Hello, world") == loaded.tokenizer.encode("Hello, world")
    assert kept.config == loaded.config


@pytest.fixture
def decided(tmp_path, monkeypatch):
    """"auto" follows a decision a quiet start cached (at `tmp_path`/choice.json): int4-a8.
    (Timed here, beside the other test worker, the machine would be busy and nothing kept.)"""
    from llmserve.loader import model_loader
    from llmserve.loader.kernel_choice import cached_choice

    path = tmp_path / "choice.json"
    path.write_text(json.dumps({"quantization": "int4-a8", "why": "3 rounds; in a test",
                                "ms": {"int4-a8": {"1": 6.5, "32": 64.5}}}))
    monkeypatch.setattr(model_loader, "choose_quantization",
                        lambda stored, config, block_type="Q4_K", retime=False:
                        cached_choice(path))
    return path


def test_the_default_model_kept_under_auto(smollm2_gguf, cache, loads, decided, caplog):
    """"auto" on the default model: the hit says the decision it followed, as a start that
    times nothing says it, and generates what the loaded model generates."""
    from llmserve import SamplingParams
    from tests.engines import llm_on

    loaded = load(str(smollm2_gguf), quantization="auto")
    with caplog.at_level(logging.INFO, logger="llmserve.loader.model_loader"):
        kept = load(str(smollm2_gguf), quantization="auto")
    assert loads == ["miss", "hit"]
    assert kept.quantization == loaded.quantization == "int4-a8"
    assert any(r.getMessage().startswith("auto runs int4-a8 (cached; 3 rounds; in a test")
               for r in caplog.records)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    tokens = [[o.outputs[0].token_ids for o in llm_on(m, kv_cache_memory="32MiB")
               .generate(prompts, greedy, use_tqdm=False)] for m in (loaded, kept)]
    assert tokens[0] == tokens[1]


def test_an_entry_answers_only_its_request_and_files(tmp_path, smollm2_gguf, cache, loads):
    import os
    import shutil

    path = tmp_path / "model.gguf"
    shutil.copy(smollm2_gguf, path)
    load(str(path), quantization="int8")
    load(str(path), quantization="int4")  # another request: its own entry
    assert loads == ["miss", "miss"] and len(_entries(cache)) == 2
    load(str(path), quantization="int8")
    assert loads[-1] == "hit"
    stat = path.stat()  # the file changed: loaded again, and its old entry replaced
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load(str(path), quantization="int8")
    assert loads[-1] == "miss" and len(_entries(cache)) == 2
    load(str(path), quantization=None)  # the exact float path is never kept
    assert len(loads) == 4 and len(_entries(cache)) == 2


def test_a_changed_decision_or_a_busy_one_is_not_followed(smollm2_gguf, cache, loads, decided,
                                                         monkeypatch):
    from llmserve.loader import model_loader

    load(str(smollm2_gguf), quantization="auto")
    load(str(smollm2_gguf), quantization="auto")
    assert loads == ["miss", "hit"]
    saved = json.loads(decided.read_text())
    decided.write_text(json.dumps(saved | {"why": "4 rounds; retimed"}))  # `--retime`
    load(str(smollm2_gguf), quantization="auto")
    assert loads[-1] == "miss" and len(_entries(cache)) == 1  # and kept afresh

    # a busy machine's choice: the model it loads is not kept
    for entry in cache.iterdir():
        entry.unlink()
    busy = KernelChoice("int4-a8", {}, "busy", "others used 1.0 of 2 cores")
    monkeypatch.setattr(model_loader, "choose_quantization",
                        lambda stored, config, block_type="Q4_K", retime=False: busy)
    assert load(str(smollm2_gguf), quantization="auto").quantization == "int4-a8"
    assert _entries(cache) == []


def test_a_damaged_entry_is_removed_and_the_files_loaded(smollm2_gguf, cache, loads, caplog):
    loaded = load(str(smollm2_gguf), quantization="int8")
    [entry] = _entries(cache)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 3])
    with caplog.at_level(logging.WARNING, logger="llmserve.loader.weight_cache"):
        again = load(str(smollm2_gguf), quantization="int8")
    assert loads == ["miss", "miss"]
    assert any("cannot read the kept weights" in r.getMessage() for r in caplog.records)
    assert torch.equal(full_logits(again.model, IDS), full_logits(loaded.model, IDS))
    assert len(_entries(cache)) == 1  # written afresh


@pytest.mark.parametrize(("total_gib", "free_gib", "kept"), [
    (20, 1.9, False),  # a small disk: under a tenth of it left free
    (20, 2.1, True),
    (2000, 7.9, False),  # a large disk: under 8 GiB left free
    (2000, 8.1, True),  # a tenth of it is more than 8 GiB: 8 GiB is enough
])
def test_an_entry_is_not_kept_where_the_disk_is_short(smollm2_gguf, cache, monkeypatch, caplog,
                                                       total_gib, free_gib, kept):
    monkeypatch.setattr(weight_cache, "_disk_short", DISK_SHORT)
    usage = shutil._ntuple_diskusage(int(total_gib * 2**30), 0, int(free_gib * 2**30))
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda path: usage)
    with caplog.at_level(logging.INFO, logger="llmserve.loader.weight_cache"):
        load(str(smollm2_gguf), quantization="int8")
    assert len(_entries(cache)) == int(kept)
    assert not list(cache.glob("*.tmp"))
    assert kept or "of the disk would be left free" in caplog.records[-1].getMessage()


def test_turned_off_it_keeps_nothing(smollm2_gguf, cache, loads, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "0")
    load(str(smollm2_gguf), quantization="int8")
    load(str(smollm2_gguf), quantization="int8")
    assert loads == ["miss", "miss"] and _entries(cache) == []


def test_an_entry_others_may_write_is_not_read(smollm2_gguf, cache, loads, caplog):
    """An entry is a pickle: one that another user could have written is never read."""
    load(str(smollm2_gguf), quantization="int8")
    [entry] = _entries(cache)
    for item, mode in ((entry, 0o666), (cache, 0o777)):
        before = item.stat().st_mode
        item.chmod(mode)
        with caplog.at_level(logging.WARNING, logger="llmserve.loader.weight_cache"):
            load(str(smollm2_gguf), quantization="int8")
        item.chmod(before)
        assert loads[-1] == "miss"
        assert f"others may write to {item}" in caplog.records[-1].getMessage()
    load(str(smollm2_gguf), quantization="int8")
    assert loads[-1] == "hit"


def test_an_entry_is_written_once_the_engine_is_ready(smollm2_gguf, cache, loads):
    """The load only pickles the object graph; the tensors are written when an engine says
    its timings are done, on a background thread, and the graph kept is the one loaded
    even where the engine changes the model after (adapters wrap its layers)."""
    loaded = load_model(str(smollm2_gguf), quantization="int8")
    assert _entries(cache) == []
    loaded.model.changed_after_loading = True
    weight_cache.write_queued()
    assert weight_cache.flush(120) and len(_entries(cache)) == 1
    kept = load(str(smollm2_gguf), quantization="int8")
    assert loads == ["miss", "hit"]
    assert not hasattr(kept.model, "changed_after_loading")
    assert torch.equal(full_logits(kept.model, IDS), full_logits(loaded.model, IDS))


def test_an_engine_keeps_what_it_loaded(smollm2_gguf, cache, loads):
    from llmserve import LLM

    LLM(str(smollm2_gguf), quantization="int8", kv_cache_memory="32MiB")
    assert weight_cache.flush(120) and len(_entries(cache)) == 1
    LLM(str(smollm2_gguf), quantization="int8", kv_cache_memory="32MiB")
    assert loads == ["miss", "hit"]


def test_a_pipeline_stage_keeps_its_share(smollm2_gguf, cache, loads):
    """A stage's layers are kept without its process group: the next start of the same
    stage maps them and gets its own live stage in its place; another stage does not."""
    from llmserve.distributed.pipeline import PipelineStage

    first = load(str(smollm2_gguf), quantization="int8",
                 stage=PipelineStage(1, 2, channels="the first start's channels"))
    again = PipelineStage(1, 2, channels="the second start's channels")
    kept = load(str(smollm2_gguf), quantization="int8", stage=again)
    assert loads == ["miss", "hit"]
    assert kept.model.stage is again and again.layers == first.model.stage.layers
    assert kept.model.model.embed_tokens is None and kept.model.lm_head is None
    load(str(smollm2_gguf), quantization="int8", stage=PipelineStage(0, 2))
    assert loads[-1] == "miss"
    # the same stage with other layers (a partition, a new measured split) loads them
    other = load(str(smollm2_gguf), quantization="int8",
                 stage=PipelineStage(1, 2, layers=range(20, 30)))
    assert loads[-1] == "miss" and other.model.held_layers == range(20, 30)


def test_a_killed_writer_leaves_nothing_behind(smollm2_gguf, cache, loads):
    """A partial entry of a process that is gone is removed by the next write; a live
    process's is left alone."""
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    cache.mkdir(parents=True)
    dead, alive = cache / f"0123abcd.{gone}.tmp", cache / f"4567abcd.{os.getpid()}.tmp"
    dead.write_bytes(b"partial")
    alive.write_bytes(b"being written")
    load(str(smollm2_gguf), quantization="int8")
    assert not dead.exists() and alive.exists()
