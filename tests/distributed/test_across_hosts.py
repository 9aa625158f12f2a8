"""Ranks on several hosts: network namespaces on this machine (`hosts.py`) joined by a
bridge, each rank started in its own as torchrun would on separate machines.

* The ranks meet from the address that routes to the master (a namespace's hostname
  resolves to the loopback, where gloo's default device would listen), and a rank that
  cannot reach another says which and stops.
* `llmserve generate` under torchrun exactly as docs/scaling.md gives it: TP=2, PP=2 and
  TP=2 x PP=2 across two hosts equal one process's tokens (slow tier).
"""

import contextlib
import datetime
import json
import textwrap
import threading

import pytest
import torch.distributed as dist

from llmserve import LLM, SamplingParams
from llmserve.executor.ranks import check_reachable, free_port
from tests.distributed.hosts import llmserve_argv, namespace_hosts, torchrun_argv

MEET = textwrap.dedent("""
    import sys, torch
    from llmserve.executor.ranks import connect
    rank, master, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    ranks = connect(rank, 2, master, port, torch.device("cpu"), pipeline_size=2)
    stage = ranks.stage
    if rank == 0:
        stage.send_on(torch.arange(6.0).reshape(2, 3))
        back = stage.receive_final(2, 3, torch.float32, torch.device("cpu"))
        print("rank 0 got", back.sum().item(), flush=True)
    else:
        x = stage.receive(2, 3, torch.float32, torch.device("cpu"))
        stage.send_on(x * 2)
        stage.flush()
        print("rank 1 sent", flush=True)
""")


def test_ranks_meet_across_hosts_from_the_routed_address(tmp_path):
    """Two hosts, a pipeline's two stages: the activations go out and the final hidden
    states come back over the bridge."""
    with namespace_hosts(2) as hosts:
        script = tmp_path / "meet.py"
        script.write_text(MEET)
        master, port = hosts[0].address, 29400 + free_port() % 500
        import sys

        procs = [host.popen([sys.executable, str(script), str(rank), master, str(port)],
                            tmp_path / f"rank{rank}.log") for rank, host in enumerate(hosts)]
        codes = [p.wait(120) for p in procs]
        logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    assert codes == [0, 0], logs
    assert "rank 0 got 30.0" in logs[0] and "rank 1 sent" in logs[1]


def test_a_rank_that_cannot_reach_another_says_so():
    """Rank 0 checks every peer's published address: one it cannot connect to is named,
    with the address tried, instead of a process group that waits for ever."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    dead_port = free_port()  # nothing listens there
    store.set("reach/1", f"127.0.0.1:{dead_port}")
    errors: list[BaseException] = []

    def rank0() -> None:
        try:
            check_reachable(store, 0, 2, "127.0.0.1")
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=rank0)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert errors and f"cannot reach rank 1 at 127.0.0.1:{dead_port}" in str(errors[0])


def _single_tokens(model: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                               use_tqdm=False)]


PROMPTS = ["The sea is", "Cats are small animals that", "One, two, three,"]


@pytest.fixture(scope="module")
def single_tokens(smollm2_gguf) -> list[list[int]]:
    return _single_tokens(str(smollm2_gguf), PROMPTS, 16)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_generate_across_two_hosts_equals_one_process(smollm2_gguf, single_tokens, tmp_path,
                                                      tp, pp):
    """torchrun on each host, as docs/scaling.md gives it (`--nnodes 2 --node-rank N
    --master-addr`); tensor parallelism within a host where both fit there (TP=2 x PP=2:
    each host one stage of two ranks)."""
    with namespace_hosts(2) as hosts:
        got = generate_across(hosts, tmp_path, smollm2_gguf, tp, pp)
    assert got == single_tokens


@pytest.mark.slow
def test_pp3_across_three_hosts_equals_one_process(smollm2_gguf, single_tokens, tmp_path):
    """Three hosts on the bridge, a stage on each (two links crossed a step, and the final
    hidden states back from the third to the first)."""
    with namespace_hosts(3) as hosts:
        got = generate_across(hosts, tmp_path, smollm2_gguf, 1, 3)
    assert got == single_tokens


def generate_across(hosts, tmp_path, model, tp: int, pp: int) -> list[list[int]]:
    """`llmserve generate` of PROMPTS (greedy, 16 tokens, float32) under torchrun on
    `hosts`, TP x PP ranks spread evenly over them; each prompt's token ids."""
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    _torchrun_on(hosts, tmp_path, [
        "generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"), "--dtype", "float32",
        "--temperature", "0", "--max-tokens", "16", "--tensor-parallel-size", str(tp),
        "--pipeline-parallel-size", str(pp),
        "--distributed-executor-backend", "external_launcher"], nproc=tp * pp // len(hosts))
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    return [json.loads(line)["token_ids"] for line in lines]


def _torchrun_on(hosts, tmp_path, command: list[str], nproc: int = 1,
                 timeout: float = 600) -> list[str]:
    """`llmserve <command>` under torchrun on each host (node 0 the master); the hosts'
    logs, after every node exited 0."""
    master, port = hosts[0].address, 29000 + free_port() % 900
    procs = [host.popen(torchrun_argv(len(hosts), node, nproc, master, port)
                        + llmserve_argv() + command, tmp_path / f"node{node}.log")
             for node, host in enumerate(hosts)]
    codes = [p.wait(timeout) for p in procs]
    logs = [(tmp_path / f"node{n}.log").read_text() for n in range(len(hosts))]
    assert codes == [0] * len(hosts), [log[-2000:] for log in logs]
    return logs


@pytest.mark.slow
def test_step_time_over_a_slow_link_matches_the_plan(smollm2_gguf, tmp_path):
    """PP=2 across two hosts 50 ms apart (each way): `llmserve bench latency`'s decode step
    against `llmserve memory`'s plan for that link: within 25 %. (The floor is one round
    trip a step: the activations out, the final hidden states back.)"""
    import re
    import subprocess

    from tests.distributed.hosts import delay_link

    with delay_link(2, delay_s=0.05) as (hosts, link):
        _torchrun_on(hosts, tmp_path, [
            "bench", "latency", "--model", str(smollm2_gguf), "--batch", "1",
            "--input-len", "16", "--output-len", "16", "--repeat", "1",
            "--output-json", str(tmp_path / "latency.json"), "--pipeline-parallel-size", "2",
            "--distributed-executor-backend", "external_launcher"])
    tpot = json.loads((tmp_path / "latency.json").read_text())["runs"][0]["tpot_s"]
    plan = subprocess.run(llmserve_argv() + [
        "memory", "--model", str(smollm2_gguf), "-pp", "2", "--link-gbit", "1",
        "--link-latency-ms", "50"], capture_output=True, text=True, check=True).stdout
    planned = float(re.search(r"= ([0-9.]+) ms a token", plan).group(1)) / 1e3
    assert link.forwarded > 0
    assert abs(tpot - planned) <= 0.25 * planned, (tpot, planned, plan)


@pytest.mark.slow
def test_a_lossy_link_slows_and_never_corrupts(smollm2_gguf, single_tokens, tmp_path):
    """5 % of the packets each way dropped (TCP sends them again): PP=2 across the two
    hosts still equals one process's tokens."""
    from tests.distributed.hosts import delay_link

    with delay_link(2, delay_s=0.002, loss=0.05) as (hosts, link):
        got = generate_across(hosts, tmp_path, smollm2_gguf, 1, 2)
    assert link.dropped > 0
    assert got == single_tokens


def wait_healthy(client, server, log, timeout: float = 300) -> None:
    """Until the server behind `client` answers /health 200 (its process alive)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and server.poll() is None, log.read_text()[-3000:]
        time.sleep(1)


@pytest.mark.slow
def test_a_host_that_dies_gets_503_and_the_server_exits(smollm2_gguf, tmp_path):
    """`llmserve serve` with PP=2 across two hosts: it answers; the second host's processes
    are killed; the next request gets a 503 naming the lost rank (no hang), and the
    server exits non-zero for its launcher to start the ranks again."""
    import time

    import httpx

    with namespace_hosts(2) as hosts:
        master, port = hosts[0].address, 29000 + free_port() % 900
        http_port = 18000 + free_port() % 1000
        command = ["serve", "--model", str(smollm2_gguf), "--host", "0.0.0.0", "--port",
                   str(http_port), "--pipeline-parallel-size", "2",
                   "--distributed-executor-backend", "external_launcher"]
        procs = [host.popen(torchrun_argv(2, node, 1, master, port) + llmserve_argv()
                            + command, tmp_path / f"node{node}.log")
                 for node, host in enumerate(hosts)]
        url = f"http://{master}:{http_port}"
        body = {"model": "x", "prompt": "The sea is", "max_tokens": 8, "temperature": 0}
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_healthy(client, procs[0], tmp_path / "node0.log")
            body["model"] = client.get("/v1/models").json()["data"][0]["id"]
            served = client.post("/v1/completions", json=body)
            assert served.status_code == 200, served.text
            hosts[1].kill()
            started = time.monotonic()
            lost = client.post("/v1/completions", json=body)
            assert lost.status_code == 503, lost.text
            assert "went away" in lost.text or "unavailable" in lost.text
            assert time.monotonic() - started < 60
        code = procs[0].wait(120)
    assert code != 0


@contextlib.contextmanager
def ray_cluster(hosts, tmp_path):
    """`ray start` on each host (one CPU each, the first the head); stopped on exit."""
    import shutil
    import sys
    from pathlib import Path

    ray = Path(sys.executable).with_name("ray")
    if not ray.exists() or shutil.which("ip") is None:
        pytest.skip("Ray is not installed")
    common = ["--num-cpus=1", "--disable-usage-stats"]
    head = hosts[0].address
    env = {"RAY_AUTH_MODE": "disabled"}
    started = []
    try:
        for i, host in enumerate(hosts):
            where = ["--head", "--port=6379", "--include-dashboard=false"] if i == 0 else \
                [f"--address={head}:6379"]
            result = host.popen([str(ray), "start", *where, f"--node-ip-address={host.address}",
                                 *common], tmp_path / f"ray{i}.log", **env)
            assert result.wait(120) == 0, (tmp_path / f"ray{i}.log").read_text()[-2000:]
            started.append(host)
        yield f"{head}:6379", env
    finally:
        for host in reversed(started):
            host.run([str(ray), "stop", "--force"], check=False)


@pytest.mark.slow
def test_ray_places_tp2_across_two_hosts_and_serves(smollm2_gguf, single_tokens, tmp_path):
    """A Ray cluster of two namespace hosts (one CPU each): `llmserve serve -tp 2
    --distributed-executor-backend ray` on the head places rank 1 on the other host; its
    greedy completions equal one process's; SIGTERM shuts it down cleanly (exit 0, the
    rank's actor gone)."""
    import signal

    import httpx

    with namespace_hosts(2) as hosts, ray_cluster(hosts, tmp_path) as (address, env):
        http_port = 18000 + free_port() % 1000
        server = hosts[0].popen(llmserve_argv() + [
            "serve", "--model", str(smollm2_gguf), "--host", "0.0.0.0", "--port",
            str(http_port), "--dtype", "float32", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "ray", "-v"], tmp_path / "serve.log",
            RAY_ADDRESS=address, **env)
        url = f"http://{hosts[0].address}:{http_port}"
        with httpx.Client(base_url=url, timeout=120) as client:
            wait_healthy(client, server, tmp_path / "serve.log")
            model = client.get("/v1/models").json()["data"][0]["id"]
            got = [client.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 16, "temperature": 0,
                "return_token_ids": True}).json() for p in PROMPTS]
        server.send_signal(signal.SIGTERM)
        code = server.wait(120)
        log = (tmp_path / "serve.log").read_text()
    assert code == 0, log[-3000:]
    assert f"rank 1: {hosts[1].address}" in log  # placed on the other host
    assert [c["choices"][0]["token_ids"] for c in got] == single_tokens


@pytest.mark.slow
def test_ray_serve_replicas_on_two_hosts(smollm2_gguf, single_tokens, tmp_path):
    """`llmserve serve --data-parallel-size 2 --data-parallel-backend ray` on a Ray cluster
    of two namespace hosts (one CPU each): a replica on each host, the greedy completions
    one process's through Ray Serve's proxy (streamed too); Ray's request router is our
    prefix affinity (a prompt prefix keeps its replica, prefixes spread over both);
    SIGTERM deletes the application (each replica's server stopped) and exits 0."""
    import signal

    import httpx

    with namespace_hosts(2) as hosts, ray_cluster(hosts, tmp_path) as (address, env):
        http_port = 18000 + free_port() % 1000
        server = hosts[0].popen(llmserve_argv() + [
            "serve", "--model", str(smollm2_gguf), "--host", "0.0.0.0", "--port",
            str(http_port), "--dtype", "float32", "--data-parallel-size", "2",
            "--data-parallel-backend", "ray"], tmp_path / "serve.log",
            RAY_ADDRESS=address, **env)
        url = f"http://{hosts[0].address}:{http_port}"
        with httpx.Client(base_url=url, timeout=120) as client:
            wait_healthy(client, server, tmp_path / "serve.log", timeout=400)
            model = client.get("/v1/models").json()["data"][0]["id"]
            got = [client.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 16, "temperature": 0,
                "return_token_ids": True}).json() for p in PROMPTS]
            with client.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": PROMPTS[0], "max_tokens": 16,
                    "temperature": 0, "stream": True}) as streamed:
                events = [line for line in streamed.iter_lines() if line.startswith("data:")]

            def replica(prompt: str) -> str:
                answer = client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 2})
                assert answer.status_code == 200, answer.text
                return answer.headers["x-llmserve-replica"]

            # one after another (no load): a prompt prefix keeps its replica; twelve
            # prefixes use both (all on one: 1 in 2,048)
            stems = [f"Document {i}: " + "the same long opening of a document. " * 8
                     for i in range(12)]
            affinity = [{replica(stem + f"question {q}?") for q in range(3)} for stem in stems]

        def replica_servers(host) -> list[str]:  # started by a replica: on port 0
            return [c for c in host.commands() if "llmserve.entrypoints.cli" in c
                    and "--port 0" in c]

        servers = [replica_servers(host) for host in hosts]
        server.send_signal(signal.SIGTERM)
        code = server.wait(180)
        log = (tmp_path / "serve.log").read_text()
        left = [replica_servers(host) for host in hosts]
    assert code == 0, log[-3000:]
    assert [c["choices"][0]["token_ids"] for c in got] == single_tokens
    assert len(events) > 2 and events[-1] == "data: [DONE]"
    assert [len(s) for s in servers] == [1, 1]  # a replica's server on each host
    assert all(len(names) == 1 for names in affinity), affinity
    assert len(set().union(*affinity)) == 2, affinity
    assert left == [[], []]


@pytest.mark.slow
def test_ray_serve_autoscales_on_requests_in_flight(smollm2_gguf, tmp_path):
    """One replica to start, up to two (`--max-data-parallel-size 2
    --target-ongoing-requests 2`): twelve long requests at once bring the second replica
    up on the other host while they run; every request is answered."""
    import concurrent.futures
    import signal
    import time

    import httpx

    with namespace_hosts(2) as hosts, ray_cluster(hosts, tmp_path) as (address, env):
        http_port = 18000 + free_port() % 1000
        server = hosts[0].popen(llmserve_argv() + [
            "serve", "--model", str(smollm2_gguf), "--host", "0.0.0.0", "--port",
            str(http_port), "--data-parallel-size", "1", "--data-parallel-backend", "ray",
            "--max-data-parallel-size", "2", "--target-ongoing-requests", "2"],
            tmp_path / "serve.log", RAY_ADDRESS=address, **env)
        url = f"http://{hosts[0].address}:{http_port}"

        def replicas() -> int:
            return sum(1 for host in hosts for c in host.commands()
                       if "llmserve.entrypoints.cli" in c and "--port 0" in c)

        with httpx.Client(base_url=url, timeout=600) as client:
            wait_healthy(client, server, tmp_path / "serve.log", timeout=400)
            assert replicas() == 1
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400,
                    "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                answers = [pool.submit(client.post, "/v1/completions", json=body)
                           for _ in range(12)]
                deadline, scaled = time.monotonic() + 240, False
                while not scaled and time.monotonic() < deadline and \
                        not all(a.done() for a in answers):
                    scaled = replicas() == 2
                    time.sleep(1)
                codes = [a.result().status_code for a in answers]
        server.send_signal(signal.SIGTERM)
        code = server.wait(180)
    assert scaled, (tmp_path / "serve.log").read_text()[-3000:]
    assert codes == [200] * 12 and code == 0


@pytest.fixture(scope="module", params=["llama3", "gemma3", "qwen3_moe"])
def tiny_family(request, tmp_path_factory):
    from tests.distributed.test_tensor_parallel import tiny_folder

    folder = tmp_path_factory.mktemp(f"hosts-{request.param}")
    return folder, tiny_folder(folder, request.param, num_layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_families_across_two_hosts_equal_the_reference(tiny_family, tmp_path, tp, pp):
    """Four-layer Llama-3, Gemma 3 and Qwen3-MoE folders, PP=2 and TP=2 x PP=2 across two
    hosts under torchrun: greedy tokens the reference's (transformers on the same
    weights)."""
    import torch

    from tests.models.test_compile import NUM_TOKENS
    from tests.models.test_llama_reference import reference_greedy

    folder, reference = tiny_family
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [ids[:20], ids[20:60]]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    with namespace_hosts(2) as hosts:
        _torchrun_on(hosts, tmp_path, [
            "generate", "--model", str(folder), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), "--dtype", "float32",
            "--temperature", "0", "--max-tokens", str(NUM_TOKENS), "--ignore-eos",
            "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--kv-cache-memory", "16MiB",
            "--distributed-executor-backend", "external_launcher"], nproc=tp * pp // 2)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["token_ids"] for line in lines] == \
        [reference_greedy(reference, p, NUM_TOKENS) for p in prompts]
