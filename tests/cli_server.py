"""`llmserve serve` as a user starts it: a subprocess whose first stdout line names its URL."""

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cli_server(args: list[str], entry: list[str] | None = None,
               start_timeout: float = 180.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, base URL ending in /v1) of `llmserve serve ARGS`; `entry` replaces
    `-m llmserve.entrypoints.cli` (a `-c` script wrapping the CLI). The process is
    terminated (then killed) on exit if it still runs."""
    cmd = [sys.executable, *(entry or ["-m", "llmserve.entrypoints.cli"]), "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(start_timeout)
        assert lines and lines[0], f"no URL printed; stderr: {proc.stderr.read()[-2000:]}"
        yield proc, re.search(r"http://\S+", lines[0]).group(0)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
