"""The package's layering, kept: import-linter checks the contracts in pyproject.toml (each
layer imports only from the layers below it, no cycles among the modules of any package,
transformers and accelerate never imported), every module sits in a layer, and no chain
of imports comes back to where it started. Imports inside functions count."""

import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
# packages that hold no code of their own, only their layers
NAMESPACES = {"llmserve.entrypoints"}
# `import llmserve` offers the public API lazily (`llmserve.LLM`, ...)
PUBLIC_API = {"llmserve.llm", "llmserve.outputs", "llmserve.sampling_params",
              "llmserve.pooling_params", "llmserve.lora_request"}


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("llmserve", cache_dir=None)


def test_import_contracts_are_kept(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                        no_logo=True)
    report = capsys.readouterr().out
    assert code == 0, report


def test_every_module_sits_in_a_layer():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    (container,) = contract["containers"]
    layers = {f"{container}.{name.strip()}" for layer in contract["layers"]
              for name in layer.split("|")}
    graph = _graph()
    outside = sorted(m for m in graph.modules - {"llmserve"} - NAMESPACES
                     if not any(m == layer or m.startswith(layer + ".") for layer in layers))
    assert outside == [], f"modules in no layer of pyproject.toml: {outside}"
    for namespace in NAMESPACES:
        assert graph.find_modules_directly_imported_by(namespace) == set()
    assert graph.find_modules_directly_imported_by("llmserve") <= PUBLIC_API


def test_no_import_cycles():
    graph = _graph()
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                cycles.append(" -> ".join((importer, *back)))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)
