"""No model file can run code: the package never unpickles a file, never evaluates text as
Python, never asks for remote code (SECURITY.md). Read from the sources' syntax trees, so
comments and strings do not count and an aliased import does not hide a call."""

import ast
from pathlib import Path

import llmserve

PACKAGE = Path(llmserve.__file__).parent
# calls that run code or unpickle: by their dotted name, after import aliases are resolved
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "torch.load", "pickle.load",
                   "pickle.loads", "pickle.Unpickler", "marshal.load", "marshal.loads",
                   "dill.load", "dill.loads", "joblib.load", "shelve.open",
                   "torch.serialization.load", "numpy.load"}
FORBIDDEN_KEYWORDS = {"trust_remote_code", "allow_pickle", "weights_only"}
# Tensor-parallel ranks trust each other: workers unpickle rank 0's step messages, which
# never come from a file or a client (SECURITY.md, "Not promised"). The weight cache reads
# back the loaded models the server itself kept, from the user's own cache folder only
# (SECURITY.md, "Model files cannot run code"; tests/loader/test_weight_cache.py): its
# tensors through torch.load(weights_only=True), its object graph through an Unpickler.
ALLOWED = {("executor/ranks.py", "pickle.loads"), ("loader/weight_cache.py", "torch.load"),
           ("loader/weight_cache.py", "pickle.Unpickler")}


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it imports ("np" -> "numpy", "load" -> "pickle.load")."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]  # `import a.b` binds `a`
                names[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _scan(source: str, where: str) -> list[str]:
    """`where:line: name()` for each forbidden call (`name=` for a forbidden keyword)."""
    tree = ast.parse(source, filename=where)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):  # a subclass of an unpickler unpickles too
            found += [(node.lineno, f"class ({name})") for name in
                      (_dotted(base, aliases) for base in node.bases)
                      if name in FORBIDDEN_CALLS and (where, name) not in ALLOWED]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if (where, name) in ALLOWED:
            continue
        if name in FORBIDDEN_CALLS:
            found.append((node.lineno, f"{name}()"))
        found += [(node.lineno, f"{k.arg}=") for k in node.keywords
                  if k.arg in FORBIDDEN_KEYWORDS]
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_no_source_unpickles_evaluates_or_trusts_remote_code():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 50
    findings = [f for path in sources
                for f in _scan(path.read_text(encoding="utf-8"),
                               path.relative_to(PACKAGE).as_posix())]
    assert findings == []


def test_the_scan_sees_aliased_and_dotted_calls():
    """The check itself can fail: each spelling of a forbidden call is found, and
    nn.Module.eval() is not one."""
    source = ("import pickle as pk\nimport torch\nfrom numpy import load as npload\n"
              "pk.load(f)\ntorch.load(p)\nnpload(p)\neval('1')\nmodel.eval()\n"
              "AutoModel.from_pretrained(p, trust_remote_code=True)\n"
              "class Reader(pk.Unpickler):\n    pass\n")
    assert _scan(source, "probe.py") == [
        "probe.py:4: pickle.load()", "probe.py:5: torch.load()", "probe.py:6: numpy.load()",
        "probe.py:7: eval()", "probe.py:9: trust_remote_code=",
        "probe.py:10: class (pickle.Unpickler)"]
