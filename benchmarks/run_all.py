"""Every side-by-side benchmark of docs/benchmarks.md, in one command.

    python benchmarks/run_all.py [--isa native|avx2] [--gguf FILE | --shape NAME [--qtype T]]
                                 [--out DIR] [--only STAGE] [--smoke]

Stages, one engine at a time, 2 threads each:
1. offline: the same 32 chat prompts x 64 tokens through transformers' static-batch
   `generate` and llmserve's `LLM.generate` in each variant (benchmarks/offline.py);
2. latency: `llmserve bench latency --batch 1,8,32` per variant (prefill, TPOT, MBU, MFU);
3. llama-bench: llama.cpp's own pp128/tg128 figures on the same GGUF;
4. serving: llama.cpp's C++ `llama-server` (32 parallel slots, continuous batching) and
   `llmserve serve` in each variant, each alone, driven by `llmserve bench serve` at
   concurrency 1/16/32 (32 requests x (128 in, 64 out) per level), with start-to-healthy
   seconds and peak RSS of each server; then `llmserve bench plot`.

llmserve variants: `default` (no dtype/quantization flags: the fast path, a 4-bit GGUF on
the int4 kernels) and `fp32` (`--dtype float32`, the exact path); fp32 files end in
`_fp32` / `-fp32`. During every stage the machine's load is sampled (benchmarks/monitor.py)
and a warning printed when other processes used more than a tenth of a core. Results
(JSON, serve.png, commands.txt, meta.json) go to --out; then benchmarks/summarize.py
writes summary.md there and --doc (docs/benchmarks.md). --smoke runs tiny sizes only to
check that everything works end to end; its figures mean nothing.

--isa avx2 runs both engines at the AVX2 level on any x86 machine: llmserve with
LLMSERVE_CPU_ISA=avx2 and llama.cpp's AVX2-only build (`ISA=avx2 build_llama_server.sh`,
bin-avx2/), into benchmarks/results-avx2; summarize.py renders it as its own section of
docs/benchmarks.md beside the machine's own level (benchmarks/results).

--shape NAME --qtype TYPE runs everything on a random-weight file of a public 1-8B model's
shape (benchmarks/shapes.py: llama-3.2-1b ... llama-3.1-8b; F16, Q8_0, Q4_0 or any
llama-quantize type, Q4_K_M by default), written once into ~/.cache/llmserve/bench-shapes.
Its results go to benchmarks/results/shapes/<shape>.<type> (results-avx2/... with --isa
avx2) and become their own section of docs/benchmarks.md; with another --out, --doc holds
that run alone. Both servers serve it as NAME; prompts are built with SmolLM2's tokenizer,
the file's own less its padding. The fp32 variant and the offline stage's transformers
hold every weight in float32 (4 bytes a parameter: 32 GB at 8B); a run that would not fit
in the memory available stops first and says which flags leave them out.
"""

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from monitor import LoadMonitor, warning
from shapes import SHAPES, shape_gguf

HERE = Path(__file__).resolve().parent
DEFAULT_GGUF = Path.home() / ".cache/llmserve/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
ANCHORS = Path.home() / ".cache/llmserve-anchors"
# --isa -> (llama.cpp build folder, LLMSERVE_CPU_ISA, results folder)
ISAS = {"native": ("bin", None, "results"), "avx2": ("bin-avx2", "avx2", "results-avx2")}
MODEL_ID = "smollm2-135m"  # the default model's; a --shape run serves the shape's name
THREADS = 2
VARIANTS = {"default": [], "fp32": ["--dtype", "float32"]}  # extra llmserve flags
STAGES = ("offline", "latency", "llama-bench", "serving")
SERVERS = ("llama.cpp", "llmserve")
CTX_SLACK = 64  # tokens per llama.cpp slot beyond prompt + output


@dataclass(frozen=True)
class Sizes:
    num_prompts: int = 32  # offline and per serving level
    input_len: int = 128  # serving and latency prompt tokens
    output_len: int = 64
    concurrency: tuple[int, ...] = (1, 16, 32)
    batch: tuple[int, ...] = (1, 8, 32)
    llama_bench: tuple[str, ...] = ("-p", "128", "-n", "128")


SMOKE = Sizes(num_prompts=4, input_len=16, output_len=8, concurrency=(1, 2), batch=(1, 2),
              llama_bench=("-p", "16", "-n", "8", "-r", "1"))


def csv(xs: tuple[int, ...]) -> str:
    return ",".join(map(str, xs))


def command_line(cmd: list[str], env: dict[str, str] | None = None) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()),
                     shlex.join(cmd)])


def llmserve_command() -> str:
    """The llmserve CLI beside this Python (a venv need not be activated), else from PATH."""
    beside = Path(sys.executable).with_name("llmserve")
    return str(beside) if beside.exists() else "llmserve"


@dataclass
class Session:
    gguf: Path
    out: Path
    llama_server: Path
    sizes: Sizes
    variants: list[str]
    isa: str = "native"
    shape: str | None = None  # a benchmarks/shapes.py name, for a --shape run
    qtype: str | None = None
    llmserve: str = field(default_factory=llmserve_command)
    load: dict = field(default_factory=dict)  # stage -> LoadMonitor.summary()
    servers: dict = field(default_factory=dict)  # label -> start-up, memory

    def sh(self, cmd: list[str], env: dict[str, str] | None = None,
           capture: bool = False) -> str:
        """Run a command (logged to commands.txt as run); its stdout when `capture`."""
        env = {**self.isa_env(), **(env or {})}
        self.log(command_line(cmd, env))
        done = subprocess.run(cmd, check=True, env={**os.environ, **env},
                              stdout=subprocess.PIPE if capture else None, text=True)
        return done.stdout or ""

    @property
    def model_id(self) -> str:
        """The name both servers serve the file as."""
        return self.shape or MODEL_ID

    @property
    def tokenizer_model(self) -> str | None:
        """`bench serve --tokenizer-model`: a shape file's tokenizer is SmolLM2's plus padding
        that random prompts must not draw from, and its name is no catalog model."""
        return MODEL_ID if self.shape else None

    def isa_env(self) -> dict[str, str]:
        """LLMSERVE_CPU_ISA for every llmserve command at a named level ({} at native)."""
        level = ISAS[self.isa][1]
        return {"LLMSERVE_CPU_ISA": level} if level else {}

    def log(self, line: str) -> None:
        print(f"$ {line}", flush=True)
        with (self.out / "commands.txt").open("a") as f:
            f.write(line + "\n")

    @contextmanager
    def stage(self, name: str) -> Iterator[LoadMonitor]:
        """Sample the machine's load while the body runs; warn when it was not quiet."""
        with LoadMonitor() as monitor:
            yield monitor
        self.load[name] = summary = monitor.summary()
        other, load = summary["other_cores"], summary["load_avg_1min"]
        print(f"[{name}] {summary['seconds']:.0f} s; load average mean {load['mean'] or 0:.2f}"
              f"; other processes {other['mean'] or 0:.2f} cores mean, "
              f"{other['max'] or 0:.2f} max", flush=True)
        if line := warning(name, summary):
            print(line, flush=True)


def suffix(variant: str, sep: str = "_") -> str:
    return "" if variant == "default" else f"{sep}{variant}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(cmd: list[str], port: int, log: Path, monitor: LoadMonitor,
           env: dict[str, str] | None = None) -> Iterator[dict]:
    """Start a server; yield {start_to_healthy_s}; on exit add its peak memory and stop it.

    Healthy: GET /health answers 200 (llama-server answers 503 while loading).
    """
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    monitor.watch(proc.pid)
    info: dict = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 300:
                raise RuntimeError(f"server not healthy after 300 s; see {log}")
            time.sleep(0.1)
        info["start_to_healthy_s"] = time.perf_counter() - start
        yield info
        info.update(monitor.sample_memory(proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_offline(s: Session) -> None:
    offline = [sys.executable, str(HERE / "offline.py"), "--gguf", str(s.gguf),
               "--num-prompts", str(s.sizes.num_prompts), "--output-len", str(s.sizes.output_len)]
    with s.stage("offline"):
        s.sh([*offline, "--engine", "transformers",
              "--output-json", str(s.out / "offline_transformers.json")])
        for v in s.variants:  # right after transformers: the ratio is measured side by side
            s.sh([*offline, "--engine", "llmserve", *VARIANTS[v],
                  "--output-json", str(s.out / f"offline_llmserve{suffix(v)}.json")])


def run_latency(s: Session) -> None:
    with s.stage("latency"):
        for v in s.variants:
            s.sh([s.llmserve, "bench", "latency", "--model", str(s.gguf),
                  "--batch", csv(s.sizes.batch), "--input-len", str(s.sizes.input_len),
                  "--output-len", str(s.sizes.output_len), "--threads", str(THREADS),
                  *VARIANTS[v], "--output-json", str(s.out / f"latency_llmserve{suffix(v)}.json")])


def llama_env(s: Session) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(s.llama_server.parent)}


def run_llama_bench(s: Session) -> None:
    """llama-bench's markdown is for people; its JSON (a list, one entry per test) is kept."""
    cmd = [str(s.llama_server.with_name("llama-bench")), "-m", str(s.gguf), "-t", str(THREADS),
           *s.sizes.llama_bench, "-o", "json"]
    with s.stage("llama-bench"):
        tests = json.loads(s.sh(cmd, llama_env(s), capture=True))
    result = {"tests": {("pp" if t["n_gen"] == 0 else "tg") + str(t["n_prompt"] or t["n_gen"]):
                        {"tokens_per_s": t["avg_ts"], "stddev": t["stddev_ts"]} for t in tests},
              "build_commit": tests[0].get("build_commit"), "cpu_info": tests[0].get("cpu_info"),
              "n_threads": tests[0].get("n_threads")}
    (s.out / "llama_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print("llama-bench: " + ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s"
                                      for k, v in result["tests"].items()), flush=True)


def bench_serve(s: Session, label: str, port: int) -> None:
    s.sh([s.llmserve, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
          "--model", s.model_id, "--concurrency", csv(s.sizes.concurrency),
          "--num-prompts", str(s.sizes.num_prompts), "--input-len", str(s.sizes.input_len),
          "--output-len", str(s.sizes.output_len), "--label", label,
          *(["--tokenizer-model", s.tokenizer_model] if s.tokenizer_model else []),
          "--output-json", str(s.out / f"serve_{label}.json")])


def serve_one(s: Session, label: str, cmd: list[str], port: int,
              env: dict[str, str] | None = None) -> None:
    log = s.out / f"{label}.log"
    s.log(command_line(cmd, env) + " &")
    with s.stage(f"serving:{label}") as monitor:
        with server(cmd, port, log, monitor, env) as info:
            bench_serve(s, label, port)
    s.servers[label] = info
    if log.stat().st_size > 100_000:  # keep the results folder small
        log.unlink()


def run_serving(s: Session, servers: list[str]) -> None:
    if "llama.cpp" in servers:
        port = free_port()
        slots = max(s.sizes.concurrency)
        ctx = slots * (s.sizes.input_len + s.sizes.output_len + CTX_SLACK)
        cmd = [str(s.llama_server), "-m", str(s.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-a", s.model_id, "-t", str(THREADS), "-tb", str(THREADS), "-np", str(slots), "-cb",
               "-c", str(ctx), "--no-webui"]
        serve_one(s, "llama.cpp", cmd, port, llama_env(s))
    for v in s.variants if "llmserve" in servers else []:
        port = free_port()
        cmd = [s.llmserve, "serve", "--model", str(s.gguf), "--served-model-name", s.model_id,
               "--port", str(port), "--threads", str(THREADS), *VARIANTS[v]]
        serve_one(s, "llmserve" + suffix(v, "-"), cmd, port, s.isa_env())
    files = [str(s.out / f"serve_{n}.json") for n in ("llama.cpp", "llmserve", "llmserve-fp32")
             if (s.out / f"serve_{n}.json").exists()]
    s.sh([s.llmserve, "bench", "plot", *files, "--output", str(s.out / "serve.png")])


def write_meta(s: Session, stages: list[str], fresh: bool) -> None:
    """meta.json: per-stage load and per-server start-up/memory; a partial run (--only) adds
    to what the folder holds, a full run starts it afresh."""
    from llmserve.bench.machine import machine_info

    path = s.out / "meta.json"
    meta = {} if fresh or not path.exists() else json.loads(path.read_text())
    meta.setdefault("sessions", []).append(
        {"date": time.strftime("%Y-%m-%d %H:%M"), "stages": stages, "variants": s.variants})
    meta["machine"] = {**machine_info(), "cores": os.cpu_count(), "threads_per_engine": THREADS}
    meta["isa"] = s.isa
    meta["model_id"] = s.model_id
    if s.shape:
        shape = SHAPES[s.shape]
        meta["shape"] = {"name": s.shape, "qtype": s.qtype, "file_bytes": s.gguf.stat().st_size,
                         "params": shape.num_params, **asdict(shape)}
    meta["smoke"] = s.sizes == SMOKE
    meta["sizes"] = asdict(s.sizes)
    meta["load"] = {**meta.get("load", {}), **s.load}
    meta["servers"] = {**meta.get("servers", {}), **s.servers}
    meta["path_names"] = {str(s.gguf): "$GGUF", str(s.out): "$OUT", s.llmserve: "llmserve",
                          sys.executable: "python", str(s.llama_server.parent): "$LLAMA_BIN",
                          str(HERE.parent) + "/": ""}
    path.write_text(json.dumps(meta, indent=2) + "\n")


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="native: this CPU's own level for both engines; avx2: both capped "
                             "at AVX2 (llmserve LLMSERVE_CPU_ISA=avx2, llama.cpp's bin-avx2)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--gguf", type=Path, help=f"the model file (default {DEFAULT_GGUF})")
    model.add_argument("--shape", choices=SHAPES,
                       help="a random-weight file of this public model's shape "
                            "(benchmarks/shapes.py), written once")
    parser.add_argument("--qtype", help="with --shape: the file's type, F16, Q8_0, Q4_0 or any "
                                        "llama-quantize type (default Q4_K_M)")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results, "
                                                 "results-avx2 with --isa avx2; with --shape, "
                                                 "shapes/<shape>.<qtype> inside it)")
    parser.add_argument("--doc", type=Path, default=HERE.parent / "docs/benchmarks.md",
                        help="the Markdown report summarize.py writes")
    parser.add_argument("--llama-server", type=Path,
                        help="llama.cpp's llama-server binary (llama-bench and llama-quantize "
                             "beside it)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help="servers of the serving stage, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="llmserve variants, comma-separated: default (fast), fp32 (exact)")
    parser.add_argument("--only", choices=STAGES, action="append", help="run only this stage")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, to check the pipeline; figures mean nothing")
    args = parser.parse_args()
    if args.qtype and not args.shape:
        parser.error("--qtype goes with --shape (a --gguf file has its own type)")
    llama_bin, _, results = ISAS[args.isa]
    args.llama_server = args.llama_server or ANCHORS / llama_bin / "llama-server"
    args.default_out = HERE / results
    if args.shape:
        args.qtype = args.qtype or "Q4_K_M"
        args.default_out = args.default_out / "shapes" / f"{args.shape}.{args.qtype}"
    args.out = args.out or args.default_out
    return parser, args


def check_fp32_fits(parser: argparse.ArgumentParser, shape: str, variants: list[str],
                    stages: list[str]) -> None:
    """The fp32 variant and the offline stage's transformers hold 4 bytes a parameter;
    stop before a run the machine's memory cannot hold, saying how to leave them out."""
    from llmserve.cpu_info import memory_bytes

    users = [("the fp32 variant", "--variants default", "fp32" in variants),
             ("the offline stage", "--only latency --only llama-bench --only serving",
              "offline" in stages)]
    need, available = 4 * SHAPES[shape].num_params, memory_bytes()[1]
    if available is None or need < 0.9 * available or not any(u[2] for u in users):
        return
    parser.error(f"{shape} in float32 is {need / 2**30:.0f} GiB and {available / 2**30:.0f} "
                 "GiB are available; leave out " + " and ".join(
                     f"{what} ({flags})" for what, flags, used in users if used))


def model_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """--gguf, the default model, or the --shape file (written on first use)."""
    if args.shape is None:
        gguf = args.gguf or DEFAULT_GGUF
        if not gguf.is_file():
            parser.error(f"no GGUF at {gguf}: `llmserve pull {MODEL_ID}` fetches the default")
        return gguf
    try:
        return shape_gguf(args.shape, args.qtype, llama_bin=args.llama_server.parent)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))


def main() -> int:
    parser, args = parse_args()
    variants, servers = args.variants.split(","), args.servers.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    default_stages = [st for st in STAGES if st != "llama-bench" or "llama.cpp" in servers]
    stages = args.only or default_stages
    needs_llama = "llama-bench" in stages or ("serving" in stages and "llama.cpp" in servers)
    if needs_llama and not args.llama_server.is_file():
        isa = "ISA=avx2 " if args.isa == "avx2" else ""
        parser.error(f"no llama-server at {args.llama_server}: build it with {isa}"
                     "tools/build_llama_server.sh from the shared tools, or pass --llama-server")
    if args.shape:
        check_fp32_fits(parser, args.shape, variants, stages)
    gguf = model_file(parser, args)
    args.out.mkdir(parents=True, exist_ok=True)
    s = Session(gguf.resolve(), args.out.resolve(), args.llama_server.resolve(),
                SMOKE if args.smoke else Sizes(), variants, args.isa, args.shape, args.qtype)
    if not args.only:
        (s.out / "commands.txt").unlink(missing_ok=True)  # a full run: the folder is its own
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    os.environ.update(s.isa_env())  # meta.json's machine line names the level run
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    runners = {"offline": lambda: run_offline(s), "latency": lambda: run_latency(s),
               "llama-bench": lambda: run_llama_bench(s),
               "serving": lambda: run_serving(s, servers)}
    for stage in stages:
        runners[stage]()
    write_meta(s, stages, fresh=not args.only)
    # the whole report from benchmarks/results; a shape run kept elsewhere is its own report
    alone = [str(s.out)] if args.shape and args.out != args.default_out else []
    subprocess.run([sys.executable, str(HERE / "summarize.py"), *alone, "--doc", str(args.doc)],
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
