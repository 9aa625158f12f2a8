"""The models a many-model server offers (`llmserve serve --models-dir DIR`): every GGUF
file and Hugging Face folder directly under DIR, and the catalog's models already in the
cache; the names a request may call each one by; and the engine flags each one's process
needs (an embedding model runs the pooling runner).

Names: a file's name without `.gguf`, a folder's name, a catalog model's name. A request may
add Ollama's default tag (`x:latest`) or, for a file, name it with its extension. The folder
is read again whenever a listing is asked for or a request names a model not yet known, so
a file copied in (or a model pulled) is served without a restart.
"""

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# a split GGUF's parts: only the first is a model, named without the part suffix
_SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-\d{5}$")
# files beside a model that are not models themselves (a vision projector)
_NOT_MODELS = ("mmproj",)
# architectures a generating model's checkpoint declares
_GENERATING = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


@dataclass(frozen=True)
class ModelFile:
    """One model the server can load: its name, where it is, and its engine's flags."""

    name: str
    path: Path
    in_catalog: bool  # a catalog model in the server's own cache (not one of the user's)
    flags: tuple[str, ...] = ()  # engine flags of its own (the pooling runner)

    @property
    def format(self) -> str:
        return "gguf" if self.path.is_file() else "safetensors"

    def stamp(self) -> tuple[tuple[str, int, int], ...]:
        """(file, size, mtime) of every file it is made of: what its digest depends on."""
        return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files())

    def files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file())


def find_models(models_dir: Path | None, cache_dir: Path | None = None
                ) -> dict[str, ModelFile]:
    """Every model on offer by name: `models_dir`'s first, then the catalog's in the cache
    (a name taken twice keeps its first model, with a warning)."""
    found: dict[str, ModelFile] = {}

    def add(model: ModelFile) -> None:
        if model.name in found:
            if found[model.name].path != model.path:
                logger.warning("two models are named '%s': %s is served, %s is not",
                               model.name, found[model.name].path, model.path)
            return
        found[model.name] = model

    if models_dir is not None:
        for path in sorted(models_dir.iterdir()):
            model = _model_at(path)
            if model is not None:
                add(model)
    for model in _catalog_models(cache_dir):
        add(model)
    return found


def lookup(models: dict[str, ModelFile], name: str) -> ModelFile | None:
    """The model `name` means: its own name, with `:latest`, or a file's full name."""
    bare = name.removesuffix(":latest")
    if bare in models:
        return models[bare]
    return next((m for m in models.values() if m.path.name == bare), None)


def engine_flags(path: Path) -> tuple[str, ...]:
    """The engine flags a model needs of its own: the pooling runner for an embedding model
    (a Hugging Face folder whose architecture generates nothing, or a sentence-transformers
    folder; a GGUF file that declares a pooling type), classification for a sequence
    classifier."""
    if path.is_file():
        from llmserve.gguf_meta import open_gguf

        metadata = open_gguf(path).metadata
        arch = metadata.get("general.architecture", "")
        return ("--runner", "pooling") if f"{arch}.pooling_type" in metadata else ()
    config = _json(path / "config.json")
    architectures = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return ("--runner", "pooling", "--convert", "classify")
    generates = any(a.endswith(_GENERATING) for a in architectures)
    if (path / "modules.json").is_file() or (architectures and not generates):
        return ("--runner", "pooling")
    return ()


def _model_at(path: Path) -> ModelFile | None:
    if path.name.startswith("."):
        return None
    if path.is_file() and path.suffix == ".gguf":
        stem = path.stem
        if stem.startswith(_NOT_MODELS):
            return None
        split = _SPLIT_PART.match(stem)
        if split is not None:
            if split["part"] != "00001":
                return None
            stem = split["stem"]
        return _described(stem, path, in_catalog=False)
    if path.is_dir() and (path / "config.json").is_file():
        return _described(path.name, path, in_catalog=False)
    return None


def _described(name: str, path: Path, in_catalog: bool) -> ModelFile | None:
    try:
        flags = engine_flags(path)
    except Exception as exc:  # noqa: BLE001 - a broken file is left out, said in the log
        logger.warning("%s is not served: %s", path, exc)
        return None
    return ModelFile(name, path, in_catalog, flags)


def _catalog_models(cache_dir: Path | None) -> list[ModelFile]:
    from llmserve.loader.catalog import list_catalog

    return [model for row in list_catalog(cache_dir) if row.cached
            if (model := _described(row.name, row.path, in_catalog=True)) is not None]


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
