"""Leak probe: the default server in this process under `bench soak` load, with
tracemalloc snapshots and gc object counts compared between two points of the run."""
import asyncio
import gc
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter

import uvicorn

from llmserve.bench.soak import SoakConfig, run_soak
from llmserve.config.engine import EngineConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.engine import Engine
from llmserve.entrypoints.openai.server import ServerSettings, build_app, listening_socket

MINUTES = float(sys.argv[1]) if len(sys.argv) > 1 else 8
FIRST_S = float(sys.argv[2]) if len(sys.argv) > 2 else 120

engine = AsyncEngine(Engine(EngineConfig(model="smollm2-135m")))
app = build_app(engine, ServerSettings(model_name="smollm2-135m"))
server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
sock = listening_socket("127.0.0.1", 0)
port = sock.getsockname()[1]
threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True).start()
while not server.started:
    time.sleep(0.05)

snapshots = {}


def types() -> Counter:
    return Counter(type(o).__name__ for o in gc.get_objects())


def probe() -> None:
    time.sleep(FIRST_S)
    gc.collect()
    snapshots["first"] = (tracemalloc.take_snapshot(), types(), time.time())
    print(f"probe: first snapshot at {FIRST_S:.0f} s", file=sys.stderr, flush=True)


tracemalloc.start(8)
threading.Thread(target=probe, daemon=True).start()
report = run_soak(SoakConfig(base_url=f"http://127.0.0.1:{port}", model="smollm2-135m",
                             server_pid=os.getpid(), duration_s=MINUTES * 60,
                             sample_interval_s=20, warmup_s=FIRST_S))
gc.collect()
last, last_types, t2 = tracemalloc.take_snapshot(), types(), time.time()
first, first_types, t1 = snapshots["first"]
print(f"between the snapshots: {t2 - t1:.0f} s, {report['summary']['completed']} requests "
      "in the whole run")
filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
stats = last.filter_traces(filters).compare_to(first.filter_traces(filters), "lineno")
print("top growth by line:")
for stat in stats[:20]:
    print(" ", stat)
first_mib = sum(s.size for s in first.statistics("filename")) / 2**20
last_mib = sum(s.size for s in last.statistics("filename")) / 2**20
print(f"traced total: first {first_mib:.1f} MiB, last {last_mib:.1f} MiB")
grown = {k: last_types[k] - first_types.get(k, 0) for k in last_types}
print("object counts grown:", sorted(grown.items(), key=lambda kv: -kv[1])[:15])
s = report["summary"]
print("RSS slope", s["rss_slope_mib_per_hour"], "second half",
      s.get("rss_slope_last_half_mib_per_hour"))
