"""Shared fixtures: the real default model (fetched once into the llmserve cache)."""

import os
import sys
from pathlib import Path

# Bytecode is kept (in __pycache__, as Python does by default) even where
# PYTHONDONTWRITEBYTECODE is set: each worker and each server subprocess would otherwise
# compile the package and the rewritten test modules again, 16 s of every worker's
# collection instead of 9. Set before the first import of the package.
if sys.dont_write_bytecode:
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402

from llmserve.config.paths import cache_root  # noqa: E402
from llmserve.cpu_info import set_thread_policy  # noqa: E402
from tests.engines import llm_on  # noqa: E402

set_thread_policy()  # as the CLI does, before any test imports torch (OpenMP)

from llmserve.kernels.build import LEVEL_FEATURES  # noqa: E402  (imports torch)

# Under pytest-xdist (addopts: -n 2) each worker process takes its share of the cores, and
# the kernels' pool does not spin after a kernel (a spinning pool takes the core the other
# worker needs; subprocess servers inherit this): the workers then share the machine
# instead of fighting over it. The kernels' bits do not depend on the thread count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    os.environ.setdefault("LLMSERVE_SPIN_US", "0")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# Engines in tests run eagerly: a cold torch.compile of a model takes a minute on 2 cores.
# The compiled step has its own tests (tests/models/test_compile.py), which lift this.
os.environ.setdefault("LLMSERVE_ENFORCE_EAGER", "1")
# Models load from their files in tests: a kept packed copy (loader/weight_cache.py) would
# skip the loading a test means to exercise; tests/loader/test_weight_cache.py turns it on.
os.environ.setdefault("LLMSERVE_WEIGHT_CACHE", "0")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1 GGUF, the default model."""
    override = os.environ.get("LLMSERVE_TEST_GGUF")
    if override:
        return Path(override)
    from llmserve.loader.catalog import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def reference_model(smollm2_gguf):
    """`transformers` on the same GGUF file, fp32: the reference implementation.

    transformers reads the GGUF file itself (its reader, not ours: an error in ours cannot
    hide in the reference), which takes 13-20 s; the fp32 weights and config it produced are
    kept in the cache as safetensors, keyed by the file and the transformers version, so the
    other test worker and later runs load them in a fraction of a second."""
    import torch
    import transformers
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    stat = smollm2_gguf.stat()
    folder = (cache_root() / "test-reference" /
              f"{smollm2_gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.exists():
            _save_reference(AutoModelForCausalLM.from_pretrained(
                smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32), folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _save_reference(model, folder: Path) -> None:
    import copy
    import shutil

    from safetensors.torch import save_model

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF loader's, not a property of weights
        del config.quantization_config
    config.save_pretrained(partial)
    save_model(model, str(partial / "model.safetensors"))  # the tied embedding stored once
    partial.rename(folder)


# The default model's weights, loaded once per kind for the whole session (a load takes
# seconds): every engine of a kind shares them through `engine_on`, each with a KV cache,
# scheduler and options of its own.


def _load(gguf: Path, quantization: str | None):
    import torch

    from llmserve.loader.model_loader import load_model

    return load_model(str(gguf), torch.float32, "cpu", quantization, enforce_eager=True)


@pytest.fixture(scope="session")
def float32_model(smollm2_gguf):
    """The exact path's weights (`dtype="float32"`)."""
    return _load(smollm2_gguf, None)


@pytest.fixture(scope="session")
def default_model(smollm2_gguf):
    """The default path's weights (`dtype="auto"`: the checkpoint's int4, or what the kernel
    choice times faster on this CPU)."""
    return _load(smollm2_gguf, "auto")


@pytest.fixture(scope="session")
def int8_model(smollm2_gguf):
    """`quantization="int8"`: W8A8 linears."""
    return _load(smollm2_gguf, "int8")


@pytest.fixture(scope="session")
def int4_a8_model(smollm2_gguf):
    """`quantization="int4-a8"`: int4 weights, 8-bit activations."""
    return _load(smollm2_gguf, "int4-a8")


@pytest.fixture(scope="session")
def smollm2_llm(float32_model):
    """llmserve's offline engine on the default model, exact fp32 path."""
    return llm_on(float32_model, kv_cache_memory="256MiB")


@pytest.fixture(scope="session")
def default_llm(default_model):
    """llmserve's offline engine on the default model, default (fast) path."""
    return llm_on(default_model, kv_cache_memory="128MiB")


@pytest.fixture(params=list(LEVEL_FEATURES))  # the package's one table of levels
def kernel_level(request):
    """Runs a test with `native()` built for each instruction-set level in turn; a level this
    CPU cannot execute is skipped with the features it lacks (CI prints the skips)."""
    from llmserve import kernels

    missing = kernels.missing_features(request.param)
    if missing:
        pytest.skip(f"the {request.param} kernels need {' '.join(missing)}, which this CPU lacks")
    with kernels.using_level(request.param):
        assert kernels.native() is not None, "the native kernels must build on the test machines"
        yield request.param


# The files that take longest (measured, `--durations`), scheduled first: pytest-xdist hands
# out whole files in collection order, and one of these started last keeps one worker busy
# for a minute after the other has finished. Only the order changes; a stale entry costs
# balance, nothing else.
LONGEST_FIRST = (
    "tests/kernels/test_kernel_levels.py",
    "tests/spec_decode/test_engine_spec.py",
    "tests/structured/test_schemas.py",
    "tests/entrypoints/openai/test_structured.py",
    "tests/entrypoints/openai/test_tools.py",
    "tests/engine/test_default_path.py",
    "tests/distributed/test_disaggregated.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/engine/test_fan_out.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(),
                                         len(LONGEST_FIRST)))
