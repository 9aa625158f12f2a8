"""Ranks on several hosts: network namespaces on this machine (`hosts.py`) joined by a
bridge, each rank started in its own as torchrun would on separate machines.

* The ranks meet from the address that routes to the master (a namespace's hostname
  resolves to the loopback, where gloo's default device would listen), and a rank that
  cannot reach another says which and stops.
* `llmserve generate` under torchrun exactly as docs/scaling.md gives it: TP=2, PP=2 and
  TP=2 x PP=2 across two hosts equal one process's tokens (slow tier).
"""

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
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    nproc = tp * pp // 2
    with namespace_hosts(2) as hosts:
        master, port = hosts[0].address, 29000 + free_port() % 900
        procs = []
        for node, host in enumerate(hosts):
            argv = torchrun_argv(2, node, nproc, master, port) + llmserve_argv() + [
                "generate", "--model", str(smollm2_gguf), "--input", str(tmp_path / "in.jsonl"),
                "--output", str(tmp_path / "out.jsonl"), "--dtype", "float32",
                "--temperature", "0", "--max-tokens", "16", "--tensor-parallel-size", str(tp),
                "--pipeline-parallel-size", str(pp),
                "--distributed-executor-backend", "external_launcher"]
            procs.append(host.popen(argv, tmp_path / f"node{node}.log"))
        codes = [p.wait(600) for p in procs]
    logs = [(tmp_path / f"node{n}.log").read_text()[-2000:] for n in range(2)]
    assert codes == [0, 0], logs
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["token_ids"] for line in lines] == single_tokens
