"""llmserve leaves the process's environment as it found it: importing it sets nothing (the
thread settings are set by the CLI and the server, `cpu_info.set_thread_policy`), and
inductor's cache folder is pointed at llmserve's only while dynamo compiles."""

import json
import os
import subprocess
import sys

import torch

from llmserve.models import compile as model_compile

THREAD_VARIABLES = ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")


def _run(code: str) -> dict:
    """`code` in a fresh interpreter whose environment lacks the thread variables (this
    process has them: conftest sets them); returns the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_llmserve_changes_no_environment_variable():
    changed = _run(
        "import json, os\n"
        "before = dict(os.environ)\n"
        "import llmserve, llmserve.llm, llmserve.entrypoints.cli\n"
        "import llmserve.entrypoints.openai.server\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()"
        " if before.get(k) != after.get(k)}))\n")
    assert changed == {}, f"importing llmserve changed os.environ: {changed}"


def test_thread_policy_sets_passive_waiting_unless_the_user_chose():
    code = ("import json, os\n"
            "os.environ['OPENBLAS_NUM_THREADS'] = '3'\n"
            "from llmserve.cpu_info import set_thread_policy\n"
            "set_thread_policy()\n"
            f"print(json.dumps({{k: os.environ.get(k) for k in {THREAD_VARIABLES!r}}}))\n")
    assert _run(code) == {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "3"}


def test_inductor_cache_dir_is_llmserves_only_while_compiling(tmp_path, monkeypatch):
    """Inside a compile inductor sees llmserve's cache folder; after it, the variable is
    what it was (here: torch's default, which importing dynamo sets)."""
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    model_compile._use_inductor_cache_dir()
    before = os.environ.get(model_compile.INDUCTOR_CACHE_ENV)
    seen = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(os.environ.get(model_compile.INDUCTOR_CACHE_ENV))
        return gm.forward

    compiled = torch.compile(lambda x: x * 2 + 1, backend=backend)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert seen == [str(tmp_path / "inductor")]
    assert os.environ.get(model_compile.INDUCTOR_CACHE_ENV) == before
