"""Replica processes of `serve --data-parallel-size`, without a model: their command line,
a failed start, stopping, and dying with a parent that was killed outright."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmserve.entrypoints.cli import build_parser
from llmserve.errors import LLMServeError
from llmserve.router.launcher import (
    ReplicaProcess,
    replica_command,
    stop_replicas,
    wait_until_serving,
)
from tests.router.helpers import gone, wait_gone

REPO = Path(__file__).resolve().parents[2]


def test_replica_command_keeps_the_flags_and_overrides_the_endpoint():
    argv = ["-v", "serve", "--model", "m.gguf", "--port", "9000", "--host", "0.0.0.0",
            "--data-parallel-size", "4", "--max-model-len", "512", "--api-key", "k"]
    command = replica_command(argv, num_threads=2)
    assert command[:3] == [sys.executable, "-m", "llmserve.entrypoints.cli"]
    args = build_parser().parse_args(command[3:])
    assert (args.host, args.port, args.data_parallel_size) == ("127.0.0.1", 0, 1)
    assert (args.model, args.max_model_len, args.api_key, args.num_threads) == (
        "m.gguf", 512, "k", 2)
    assert args.verbose
    given = build_parser().parse_args(replica_command([*argv, "--threads", "3"], None)[3:])
    assert given.num_threads == 3  # --threads given: per replica, as given


def test_a_replica_that_exits_during_start_up_is_named_with_its_last_line():
    child = ReplicaProcess(1, [sys.executable, "-c",
                               "print('loading'); print('error: no such model'); exit(3)"])
    child.start_relay()
    with pytest.raises(LLMServeError) as e:
        wait_until_serving([child])
    assert str(e.value) == "replica 1 exited with code 3 during start-up: error: no such model"


def test_stop_kills_a_replica_that_ignores_sigterm():
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "print('ready', flush=True); time.sleep(60)"
    stubborn = ReplicaProcess(0, [sys.executable, "-c", script])
    polite = ReplicaProcess(1, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert stubborn.process.stdout.readline() == "ready\n"
    stop_replicas([stubborn, polite], timeout_s=0.5)
    # both would sleep on for a minute: their ends are the signals stop_replicas sent
    assert stubborn.process.returncode == -signal.SIGKILL
    assert polite.process.returncode == -signal.SIGTERM


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_replicas_die_with_a_parent_killed_outright():
    parent_script = textwrap.dedent("""
        import sys, time
        from llmserve.router.launcher import ReplicaProcess
        child = ReplicaProcess(0, [sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.process.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_script], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    assert not gone(child_pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_gone(child_pid, 5), "the replica outlived its killed parent"
