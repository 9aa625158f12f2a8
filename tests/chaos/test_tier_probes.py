"""A hostile filesystem under `--kv-offload-dir` fails no innocent request: a restarted
server on a tier folder with damaged blocks, planted symlinks, a FIFO named as a block,
junk, block files vanishing while it runs, or a folder it cannot write answers every
request with the text a server without the tier gives, and touches nothing outside.
"""

import errno
import os
from pathlib import Path

from llmserve.kv_tier import store as tier_store
from tests.entrypoints.openai.conftest import MODEL, run_server, wait_engine_idle

PROMPTS = [("A field guide to the birds of the northern coast, chapter one. " * 12
            + f"The {n} bird in this chapter is the") for n in ("first", "second", "third")]


def answers(server) -> list[str]:
    """Each prompt's greedy completion; every request must succeed."""
    client = server.client()
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS]


def filled_tier(smollm2_gguf, loaded_model, folder: Path) -> tuple[list[str], Path]:
    """(the answers of a server without a tier, the namespace folder of a tier that a
    first server wrote them into)."""
    with run_server(smollm2_gguf, loaded_model) as plain:
        expected = answers(plain)
    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"kv_offload_dir": str(folder)}) as first:
        assert answers(first) == expected
        wait_engine_idle(first)
        assert first.engine.engine.kv_tier.flush(60)
    (namespace,) = [p for p in folder.iterdir() if p.is_dir()]
    return expected, namespace


def test_a_hostile_tier_folder_fails_no_request(smollm2_gguf, loaded_model, tmp_path):
    expected, namespace = filled_tier(smollm2_gguf, loaded_model, tmp_path / "tier")
    blocks = sorted(namespace.rglob("*.kvb"))
    assert len(blocks) >= 6
    outside = tmp_path / "outside"
    outside.mkdir()
    bait = [outside / "notes.tmp9", outside / ("ab" * 32 + ".kvb")]
    for path in bait:
        path.write_bytes(b"precious")
    damaged = bytearray(blocks[0].read_bytes())
    damaged[-10] ^= 0xFF
    blocks[0].write_bytes(bytes(damaged))  # a flipped payload byte: a checksum failure
    blocks[1].write_bytes(blocks[1].read_bytes()[:100])  # torn
    (namespace / "ab").symlink_to(outside, target_is_directory=True)
    sub = blocks[2].parent
    (sub / ("ee" * 32 + ".kvb")).symlink_to(tmp_path / "nowhere")  # dangling
    os.mkfifo(sub / ("ef" * 32 + ".kvb"))  # a read would wait forever
    (sub / ("ed" * 32 + ".kvb")).mkdir()
    (namespace / "junk.bin").write_bytes(os.urandom(64))
    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"kv_offload_dir": str(tmp_path / "tier")}) as second:
        blocks[3].unlink()  # vanishing under the running server (another engine's eviction)
        assert answers(second) == expected
        rejected = second.engine.engine.kv_tier.stats.rejected
        assert rejected["checksum"] + rejected["truncated"] + rejected["size"] >= 1, rejected
        assert rejected["symlink"] >= 2, rejected
    assert all(path.read_bytes() == b"precious" for path in bait)
    assert sorted(p.name for p in outside.iterdir()) == sorted(p.name for p in bait)


def test_a_folder_it_cannot_write_turns_the_tier_read_only(smollm2_gguf, loaded_model,
                                                            tmp_path, monkeypatch):
    """A read-only mount (EROFS on every write and delete; root ignores permission bits,
    so the mount is simulated): the server starts, uses the blocks already there, adds
    and deletes none (not even a torn temporary file), and every answer is the tier-less
    server's."""
    expected, namespace = filled_tier(smollm2_gguf, loaded_model, tmp_path / "tier")
    (namespace / "junk.tmp1").write_bytes(b"a torn write of an earlier life")
    before = {p: p.read_bytes() for p in namespace.rglob("*") if p.is_file()}
    inside = str(tmp_path / "tier")

    def read_only(original):
        def refuse(path, *args, **kwargs):
            if str(path).startswith(inside):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return original(path, *args, **kwargs)
        return refuse

    real_access = os.access
    monkeypatch.setattr(tier_store.os, "access", lambda path, mode: (
        False if str(path).startswith(inside) and mode == os.W_OK else real_access(path, mode)))
    monkeypatch.setattr(tier_store.os, "replace", read_only(os.replace))
    monkeypatch.setattr(Path, "unlink", read_only(Path.unlink))
    monkeypatch.setattr(Path, "write_text", read_only(Path.write_text))
    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"kv_offload_dir": inside}) as server:
        prompts_then_new = answers(server)
        tier = server.engine.engine.kv_tier
        assert tier.read_only
        assert prompts_then_new == expected
        assert tier.stats.num_loaded > 0  # the blocks already there were used
    after = {p: p.read_bytes() for p in namespace.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing deleted
