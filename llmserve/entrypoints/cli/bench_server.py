"""`llmserve bench serve`, `soak` and `plot`: benchmarks that talk to a server over HTTP, and
their plots."""

import argparse
from collections.abc import Callable
from pathlib import Path

from llmserve.entrypoints.cli.args import int_list, int_range, parsed
from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.cli.output import write_json
from llmserve.errors import LLMServeError


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        import httpx

        from llmserve.bench.serve import ServeBenchConfig, format_summary, run_serve_bench
    except ModuleNotFoundError as e:
        raise LLMServeError(f"bench serve needs {e.name}: pip install 'llmserve[bench]'") from None
    from llmserve.bench.stats import SLO

    config = ServeBenchConfig(
        base_url=args.base_url, model=args.model, concurrencies=args.concurrency,
        request_rate=args.request_rate, burstiness=args.burstiness,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        workload=args.workload, dataset=args.dataset, shared_prefix_len=args.shared_prefix_len,
        slo=SLO(args.slo_ttft, args.slo_tpot), api_key=args.api_key, endpoint=args.endpoint,
        tokenizer_model=args.tokenizer_model, label=args.label, seed=args.seed,
        structured=args.structured)
    try:
        data = run_serve_bench(config)
    except httpx.HTTPError as e:  # what the client did not already turn into a message
        raise LLMServeError(f"talking to {config.base_url}: {type(e).__name__}: {e}") from None
    print(format_summary(data))
    if args.output_json:
        write_json(args.output_json, data)
    if args.plot:
        if not args.output_json:
            raise LLMServeError("--plot draws from the result file: give --output-json too")
        from llmserve.bench.plot import plot_reports

        plot_reports([Path(args.output_json)], Path(args.plot))
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    import shlex

    from llmserve.bench.machine import format_machine
    from llmserve.bench.soak import SoakConfig, run_soak
    from llmserve.bench.soak_report import format_soak, plot_soak

    if args.plot and not args.output_json:
        raise LLMServeError("--plot draws from the result file: give --output-json too")
    config = SoakConfig(
        base_url=args.base_url, model=args.model, server_pid=args.server_pid,
        server_args=tuple(shlex.split(args.server_args or "")), duration_s=args.duration,
        concurrency=args.concurrency, sample_interval_s=args.sample_interval,
        warmup_s=args.warmup, disconnect_fraction=args.disconnect_fraction,
        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
        api_key=args.api_key)
    print(format_machine(), flush=True)
    report = run_soak(config)
    print(format_soak(report))
    if args.output_json:
        write_json(args.output_json, report)
    if args.plot:
        plot_soak(report, Path(args.plot))
    return 0


def machine_header() -> tuple[dict, float, float | None]:
    """The machine, its read bandwidth and its load average, printed above a server
    benchmark's table (and returned for its JSON)."""
    from llmserve.bench.kernels import measure_read_bandwidth
    from llmserve.bench.machine import format_machine, machine_info
    from llmserve.cpu_info import load_average_1m

    machine = machine_info()
    bandwidth = measure_read_bandwidth()
    load_before = load_average_1m()
    print(format_machine(machine), flush=True)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; load average (1 min) before: "
          f"{load_before}", flush=True)
    return machine, bandwidth, load_before


def _measured(run: Callable[[], dict], format_report: Callable[[dict], str],
              output_json: str | None) -> int:
    """The machine header, the benchmark `run`, its table and the load after, its JSON."""
    from llmserve.cpu_info import load_average_1m

    machine, bandwidth, load_before = machine_header()
    report = run()
    report.update(machine=machine, read_bandwidth_bytes_s=bandwidth,
                  load_average_before=load_before, load_average_after=load_average_1m())
    print(format_report(report))
    print(f"load average (1 min) after: {report['load_average_after']}")
    if output_json:
        write_json(output_json, report)
    return 0


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    import os
    import shlex

    import httpx

    from llmserve.bench.hostile import HostileConfig, format_hostile, run_hostile
    from llmserve.bench.soak import ServerProcess, served_model
    from llmserve.cpu_info import load_average_1m

    server = None
    base_url = args.base_url
    fifo = None
    server_args = tuple(shlex.split(args.server_args or ""))
    if args.lora_dir is not None:
        fifo = Path(args.lora_dir) / "hostile-fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        if base_url is None:
            server_args += ("--enable-lora", "--allow-runtime-lora", "--lora-dir",
                            str(args.lora_dir))
    if base_url is None:
        server = ServerProcess(args.model, server_args)
        base_url = server.wait_until_serving()
    try:
        with httpx.Client(base_url=base_url, timeout=30) as http:
            model = served_model(http) if args.base_url is None or args.model is None \
                else args.model
        machine, bandwidth, load_before = machine_header()
        config = HostileConfig(base_url, model, repeats=args.repeats,
                               output_tokens=args.output_tokens, api_key=args.api_key,
                               fifo_adapter=None if fifo is None else fifo.name)
        report = run_hostile(config)
        report.update(machine=machine, read_bandwidth_bytes_s=bandwidth,
                      load_average_before=load_before, load_average_after=load_average_1m())
    finally:
        if server is not None:
            server.stop()
    print(format_hostile(report))
    print(f"load average (1 min) after: {report['load_average_after']}")
    if args.output_json:
        write_json(args.output_json, report)
    return 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    import shlex

    from llmserve.bench.startup import (
        StartupConfig,
        format_startup,
        run_startup,
        this_install,
        wheel_install,
    )

    installs = [this_install()]
    if args.wheel_dir:
        installs.append(wheel_install(Path(args.wheel_dir)))
    config = StartupConfig(models=tuple(args.model), installs=tuple(installs), busy=args.busy,
                           server_args=tuple(shlex.split(args.server_args or "")),
                           single_prompts=args.single_prompts, input_len=args.input_len,
                           output_len=args.output_len, repeats=args.repeats)
    return _measured(lambda: run_startup(config), format_startup, args.output_json)


def cmd_bench_models(args: argparse.Namespace) -> int:
    import shlex

    from llmserve.bench.models import ModelsBenchConfig, format_models_bench, run_models_bench

    config = ModelsBenchConfig(models=tuple(args.model),
                               server_args=tuple(shlex.split(args.server_args or "")),
                               repeats=args.repeats, prompts_per_stream=args.prompts_per_stream,
                               input_len=args.input_len, output_len=args.output_len)
    return _measured(lambda: run_models_bench(config), format_models_bench, args.output_json)


def cmd_bench_plot(args: argparse.Namespace) -> int:
    import sys

    from llmserve.bench.plot import plot_reports

    plot_reports([Path(f) for f in args.results], Path(args.output))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _serve_arguments(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", required=True, help="model id the server serves")
    sv.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    sv.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    load = sv.add_argument_group("load")
    load.add_argument("--concurrency", type=int_list, default=(1,),
                      help="concurrent requests at most; a list sweeps (default 1)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps: 1 Poisson, < 1 burstier (default 1)")
    load.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency")
    work = sv.add_argument_group("workload (every concurrency level gets prompts of its own)")
    work.add_argument("--workload", choices=("random", "shared-prefix", "jsonl"),
                      default="random", help="random: unrelated random-token prompts; "
                      "shared-prefix: one common prefix per level, to measure prefix caching")
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    work.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    work.add_argument("--shared-prefix-len", type=int, default=512,
                      help="tokens of the common prefix of --workload shared-prefix")
    work.add_argument("--dataset", metavar="FILE.jsonl",
                      help='--workload jsonl: lines {"prompt": ..., "output_len"?: N}')
    work.add_argument("--tokenizer-model", help="tokenizer for prompts (catalog name, .gguf or "
                      "folder); default: --model's own when llmserve knows it, else the "
                      "server's /tokenize")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--structured", choices=("json_schema", "json_object", "regex", "choice"),
                      help="constrain every output: json_schema (a nested object schema), "
                           "json_object (response_format), regex or choice (vLLM's "
                           "structured_outputs); outputs end when complete (<= --output-len)")
    out = sv.add_argument_group("results")
    out.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT, seconds")
    out.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT, seconds")
    out.add_argument("--output-json", metavar="FILE", help="write every field as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="plot TTFT and tokens/s (needs "
                     "--output-json)")
    out.add_argument("--label", help="name of this server in the results and plots")


def _duration(text: str) -> float:
    # imported when a duration is parsed: building the parser for every command imported
    # the soak's module, and with it torch and httpx (0.2 s of `llmserve serve`'s start)
    from llmserve.bench.soak import parse_duration

    return parse_duration(text)


def _soak_arguments(so: argparse.ArgumentParser) -> None:
    duration = parsed(_duration)
    target = so.add_argument_group("server (default: start `llmserve serve` on a free port)")
    target.add_argument("--base-url", help="soak this running server instead")
    target.add_argument("--server-pid", type=int,
                        help="with --base-url: the process whose tree's RSS is sampled")
    target.add_argument("--model", help="model to serve (default: serve's default); with "
                        "--base-url the served id (default: the first of /v1/models)")
    target.add_argument("--server-args", metavar="'FLAGS'",
                        help="more flags for the started server, e.g. '--threads 2'")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    load = so.add_argument_group("load")
    load.add_argument("--duration", type=duration, default=1800.0,
                      help="how long clients send, e.g. 20s, 30m, 2h (default 30m)")
    load.add_argument("--concurrency", type=int, default=32, help="streams at once (default 32)")
    load.add_argument("--disconnect-fraction", type=float, default=0.05,
                      help="requests hung up on mid-stream (default 0.05)")
    load.add_argument("--input-len", type=int_range, default=(16, 512), metavar="LOW:HIGH",
                      help="prompt tokens, uniform (default 16:512)")
    load.add_argument("--output-len", type=int_range, default=(16, 256), metavar="LOW:HIGH",
                      help="output tokens, uniform (default 16:256)")
    load.add_argument("--seed", type=int, default=0)
    out = so.add_argument_group("sampling and results")
    out.add_argument("--sample-interval", type=duration, default=10.0,
                     help="between samples (default 10s)")
    out.add_argument("--warmup", type=duration, default=60.0,
                     help="left out of the RSS slope (default 1m)")
    out.add_argument("--output-json", metavar="FILE", help="write the samples and summary")
    out.add_argument("--plot", metavar="FILE.png", help="plot the samples (needs --output-json)")


def _hostile_arguments(ho: argparse.ArgumentParser) -> None:
    target = ho.add_argument_group("server (default: start `llmserve serve` on a free port)")
    target.add_argument("--base-url", help="probe this running server instead")
    target.add_argument("--model", help="model to serve (default: serve's default); with "
                        "--base-url the served id (default: the first of /v1/models)")
    target.add_argument("--server-args", metavar="'FLAGS'",
                        help="more flags for the started server, e.g. '--threads 2'")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--lora-dir", metavar="DIR", help="the server's --lora-dir (a started "
                        "server gets --enable-lora --allow-runtime-lora --lora-dir DIR): a "
                        "FIFO is put there and loaded twice at once")
    ho.add_argument("--repeats", type=int, default=5,
                    help="normal chats alone and beside each probe (default 5)")
    ho.add_argument("--output-tokens", type=int, default=32,
                    help="tokens of the normal chat (default 32)")
    ho.add_argument("--output-json", metavar="FILE", help="write every figure as JSON")


def _startup_arguments(st: argparse.ArgumentParser) -> None:
    st.add_argument("--model", action="append", required=True, metavar="MODEL",
                    help="a catalog name or a model file (repeat for several)")
    st.add_argument("--wheel-dir", metavar="DIR", help="also the package as a wheel built "
                    "from this source tree and installed in a fresh virtual environment in DIR "
                    "(made once), run with no compiler on PATH")
    st.add_argument("--busy", type=int, default=4,
                    help="spinning processes beside the busy first start (default 4)")
    st.add_argument("--server-args", metavar="'FLAGS'",
                    help="more flags for every started server, e.g. '--threads 2'")
    st.add_argument("--single-prompts", type=int, default=8,
                    help="requests at one stream (default 8; 32 at 32 streams)")
    st.add_argument("--repeats", type=int, default=3,
                    help="speed runs and warm starts per row (default 3; the first speed "
                    "run is the server's warm-up): their spread is the noise a busy start's "
                    "speed is judged against")
    st.add_argument("--input-len", type=int, default=128)
    st.add_argument("--output-len", type=int, default=64)
    st.add_argument("--output-json", metavar="FILE", help="write every figure as JSON")


def _models_arguments(mo: argparse.ArgumentParser) -> None:
    mo.add_argument("--model", action="append", required=True, metavar="MODEL",
                    help="a catalog name or a model file (repeat for several); the first is "
                    "also measured alone against routed")
    mo.add_argument("--server-args", metavar="'FLAGS'",
                    help="more flags for every started server, e.g. '--threads 2'")
    mo.add_argument("--repeats", type=int, default=3,
                    help="measured runs per server and stream count, in turn (default 3, "
                    "after one warm-up run each)")
    mo.add_argument("--prompts-per-stream", type=int, default=4,
                    help="requests a run sends per stream (default 4)")
    mo.add_argument("--input-len", type=int, default=128)
    mo.add_argument("--output-len", type=int, default=64)
    mo.add_argument("--output-json", metavar="FILE", help="write every figure as JSON")


def _plot_arguments(pl: argparse.ArgumentParser) -> None:
    pl.add_argument("results", nargs="+", metavar="RESULT.json")
    pl.add_argument("--output", required=True, metavar="FILE.png")


SERVE = Command("serve", help="load-test an OpenAI-compatible server (streaming)",
                add_arguments=_serve_arguments, run=cmd_bench_serve)
SOAK = Command(
    "soak", help="hours of streamed load on one server, sampled for leaks: RSS slope, KV "
    "usage at the end, latency percentiles over time",
    add_arguments=_soak_arguments, run=cmd_bench_soak)
HOSTILE = Command(
    "hostile", help="a normal chat's latency alone and beside each hostile request (huge "
    "constraints, slowloris, a million-token prompt, adapter paths), side by side",
    add_arguments=_hostile_arguments, run=cmd_bench_hostile)
STARTUP = Command(
    "startup", help="first and warm start-up and 1/32-stream speed per install (this one, a "
    "wheel without a compiler) and first start (quiet, beside busy processes), side by side",
    add_arguments=_startup_arguments, run=cmd_bench_startup)
MODELS = Command(
    "models", help="many models behind one server: a request for an unloaded model to its "
    "first token, and a loaded model routed vs served alone at 1 and 16 streams",
    add_arguments=_models_arguments, run=cmd_bench_models)
PLOT = Command("plot", help="plot `bench serve` result files against each other",
               add_arguments=_plot_arguments, run=cmd_bench_plot)
