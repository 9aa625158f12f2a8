"""The HTTP edge is bounded: slow headers and slow bodies time out, connections are capped,
an oversized prompt is refused while it is tokenized, a foreign Host header gets nothing.

Each probe that could tie up the server runs beside a normal chat whose latency is
compared with its latency alone, measured in the same test.
"""

import socket
import statistics
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, run_server

CHAT = "/v1/chat/completions"
NORMAL = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
          "max_tokens": 24, "temperature": 0, "ignore_eos": True}
MAX_SLOWDOWN = 4.0  # as in test_grammar_budget.py
HEADER_TIMEOUT_S = 1.0


def _chat_seconds(http: httpx.Client) -> float:
    start = time.monotonic()
    reply = http.post(CHAT, json=NORMAL)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - start


def _median_chat(http: httpx.Client) -> float:
    return statistics.median(_chat_seconds(http) for _ in range(3))


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (a read gives EOF, or the connection was reset)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, header_timeout_s=HEADER_TIMEOUT_S,
                    body_timeout_s=1.0) as running:
        yield running


@pytest.fixture
def alone(server) -> float:
    with server.http() as http:
        _chat_seconds(http)
        return _median_chat(http)


def test_slow_headers_are_cut_off_and_stall_nobody(server, alone):
    """40 connections sending their headers a byte every 0.2 s (slowloris): each is
    closed once its headers are HEADER_TIMEOUT_S late; chats beside them run as alone."""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\nX-Padding: " + b"a" * 200)
    socks = [_connect(server.url) for _ in range(40)]
    stop = threading.Event()
    closed: set[int] = set()

    def drip() -> None:
        for byte in request:
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    closed.add(i)
            if stop.wait(0.2):
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        with server.http() as http:
            beside = _median_chat(http)
        deadline = time.monotonic() + 10 * HEADER_TIMEOUT_S
        while len(closed) < len(socks) and time.monotonic() < deadline:
            closed |= {i for i, s in enumerate(socks) if i not in closed and _closed_by_server(s)}
            time.sleep(0.1)
    finally:
        stop.set()
        dripper.join()
        for sock in socks:
            sock.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow connections still open"
    assert beside <= MAX_SLOWDOWN * alone, (beside, alone)


def test_a_body_that_does_not_arrive_is_a_408(server):
    sock = _connect(server.url)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        sock.settimeout(10)
        reply = b""
        while chunk := sock.recv(4096):  # the server closes the connection after it
            reply += chunk
        reply = reply.decode()
    finally:
        sock.close()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "did not arrive within 1 s" in reply


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(server, alone):
    """~1.3 million tokens (3.9 MB, under the body cap): refused once the first few
    thousand are counted, on every route that tokenizes text."""
    huge = "hi " * 1_300_000
    bodies = {"/v1/completions": ({"prompt": huge, "max_tokens": 4}, "prompt"),
              CHAT: ({"messages": [{"role": "user", "content": huge}], "max_tokens": 4},
                     "messages")}
    with server.http() as http:
        for path, (body, param) in bodies.items():
            start = time.monotonic()
            reply = http.post(path, json=body)
            refused_in = time.monotonic() - start
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param, error
            assert f"more than {MAX_MODEL_LEN} tokens" in error["message"], error
            # parsing 3.9 MB of JSON costs more than a normal chat; tokenizing it whole would
            # cost several seconds more
            assert refused_in <= 5 * MAX_SLOWDOWN * alone, (refused_in, alone)
        beside = _median_chat(http)
    assert beside <= MAX_SLOWDOWN * alone, (beside, alone)


def test_past_the_connection_cap_requests_get_503(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, max_connections=4) as server:
        idle = [_connect(server.url) for _ in range(4)]
        try:
            assert _health_becomes(server, 503), "the fifth connection was served"
        finally:
            for sock in idle:
                sock.close()
        assert _health_becomes(server, 200), "the cap did not free its connections"


def _health_becomes(server, status: int, timeout_s: float = 10.0) -> bool:
    """Whether /health answers `status` within `timeout_s` (the server has to accept the
    connections, or see them closed, first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with server.http() as http:
            if http.get("/health").status_code == status:
                return True
        time.sleep(0.05)
    return False


def test_a_foreign_host_header_is_refused(smollm2_gguf, loaded_model):
    """--allowed-hosts: a page that rebinds its own name to 127.0.0.1 sends that name."""
    with run_server(smollm2_gguf, loaded_model,
                    allowed_hosts=("localhost", "127.0.0.1", "::1")) as server, \
            server.http() as http:
        refused = http.get("/v1/models", headers={"Host": "attacker.example:8000"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "Host" and "attacker.example" in error["message"], error
        assert http.get("/v1/models").status_code == 200  # Host: 127.0.0.1:<port>
        assert http.get("/v1/models", headers={"Host": "localhost"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "[::1]:8000"}).status_code == 200
