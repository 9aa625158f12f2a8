"""`llmserve serve --models-dir`: three tiny models made here (two chat models and an
embedding model) beside the catalog's, at most two loaded: listed before they load, loaded
by the request that names them, eight clients interleaving all three with no failure, the
memory of an unloaded model given back, a model killed with SIGKILL reloaded on its next
request while the others answer throughout, keep_alive and the load/unload routes, the
`ollama` client's stream relayed line by line."""

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from llmserve.router.model_files import engine_flags, find_models, lookup
from llmserve.router.multi_model import ROUTER_FLAGS, ModelServerSettings, without_flags
from tests.cli_server import cli_server
from tests.entrypoints.openai.test_web_chat import (  # noqa: F401 - fixtures
    _chat_requests,
    _open,
    _send,
    _wait_answered,
    browser,
    page,
)
from tests.router.helpers import wait_for
from tests.tiny_models import save_tiny

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=512)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_MODELS = ("chat-llama", "chat-qwen")
EMBED_MODEL = "embed-qwen3"


def _chat_model(model, folder: Path) -> None:
    save_tiny(model, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("models")
    _chat_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
                folder / "chat-llama")
    _chat_model(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
                folder / "chat-qwen")
    save_tiny(transformers.Qwen3Model(transformers.Qwen3Config(**COMMON, head_dim=16)),
              folder / EMBED_MODEL)
    (folder / "notes.txt").write_text("not a model")
    (folder / "broken").mkdir()  # a checkpoint without its weights
    (folder / "broken" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder


@pytest.fixture(scope="module")
def server(models_dir):
    args = ["--models-dir", str(models_dir), "--max-loaded-models", "2", "--keep-alive", "-1",
            "--kv-cache-memory", "16MiB", "--threads", "1", "--port", "0"]
    with cli_server(args) as (process, url):
        with httpx.Client(base_url=url.removesuffix("/v1"), timeout=120) as http:
            yield process, http


def _status(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card["status"] for card in http.get("/v1/models").json()["data"]}


def _loaded(http: httpx.Client) -> set[str]:
    return {name for name, status in _status(http).items() if status["value"] == "loaded"}


def _ask(http: httpx.Client, model: str, text: str = "Hello") -> str:
    """A greedy answer of `model` (the embedding model: its vector's first values)."""
    if model == EMBED_MODEL:
        response = http.post("/v1/embeddings", json={"model": model, "input": text})
        assert response.status_code == 200, response.text
        return json.dumps([round(v, 4) for v in response.json()["data"][0]["embedding"][:4]])
    response = http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 6,
        "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["message"]["content"]


def _tree_rss(process) -> int:
    """Resident bytes of the server and its models' processes."""
    from llmserve.router.multi_model import resident_bytes

    children = {int(pid) for task in Path(f"/proc/{process.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()}  # of any thread
    assert children, "no model process found"
    return resident_bytes(process.pid) + sum(resident_bytes(pid) for pid in children)


# ---- the server ---------------------------------------------------------------------


def test_every_model_is_listed_before_it_loads(server, models_dir):
    _, http = server
    status = _status(http)
    for name in (*CHAT_MODELS, EMBED_MODEL):
        assert status[name] == {"value": "unloaded", "pinned": False}
    assert "notes" not in status
    tags = {m["name"]: m for m in http.get("/api/tags").json()["models"]}
    assert tags["chat-qwen:latest"]["details"]["family"] == "qwen2"
    assert tags["chat-qwen:latest"]["digest"].startswith("sha256:")
    assert not list(models_dir.rglob("*.sha256"))  # nothing written beside the user's files
    assert http.get("/api/ps").json() == {"models": []}
    missing = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert missing.status_code == 404 and "'nope' not found" in missing.json()["error"]["message"]
    ollama_missing = http.post("/api/chat", json={"model": "nope"})
    assert ollama_missing.status_code == 404
    assert "'nope' not found" in ollama_missing.json()["error"]
    nameless = http.post("/v1/completions", json={"prompt": "x"})
    assert nameless.status_code == 400 and "model" in nameless.json()["error"]["message"]


@pytest.mark.slow  # 30 s: a dozen loads
def test_eight_clients_interleave_three_models_with_two_loaded(server):
    _, http = server
    alone = {name: _ask(http, name) for name in (*CHAT_MODELS, EMBED_MODEL)}
    jobs = [(*CHAT_MODELS, EMBED_MODEL)[i % 3] for i in range(18)]
    loaded_seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            loaded_seen.append(len(_loaded(http)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda name: (name, _ask(http, name)), jobs))
    finally:
        stop.set()
        watcher.join()
    # every request answered, each model as it answers alone: loading, unloading and
    # sharing the endpoint changed no output
    assert answers == [(name, alone[name]) for name in jobs]
    assert max(loaded_seen) <= 2
    metrics = http.get("/metrics").text
    assert 'llmserve_router_model_unloads_total{model="' in metrics
    assert 'reason="evicted"' in metrics


@pytest.mark.slow  # 20 s
def test_an_unloaded_models_memory_is_given_back(server):
    process, http = server
    for name in CHAT_MODELS:
        _ask(http, name)
    assert _loaded(http) == set(CHAT_MODELS)
    two_models = _tree_rss(process)
    _ask(http, EMBED_MODEL)  # evicts the least recently used, chat-llama
    assert _loaded(http) == {"chat-qwen", EMBED_MODEL}
    after_swap = _tree_rss(process)
    assert abs(after_swap - two_models) <= 0.10 * two_models, (two_models, after_swap)
    assert http.post("/models/unload", json={"model": EMBED_MODEL}).json()["success"]
    one_model = _tree_rss(process)
    assert one_model < 0.85 * after_swap, (after_swap, one_model)


def test_a_killed_model_reloads_and_the_others_see_no_error(server):
    _, http = server
    _ask(http, "chat-llama")
    _ask(http, "chat-qwen")
    victim = _status(http)["chat-qwen"]["pid"]
    errors: list[str] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                _ask(http, "chat-llama")
            except AssertionError as exc:
                errors.append(str(exc))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _status(http)["chat-qwen"]["value"] == "unloaded", 20,
                 "the killed model was not noticed")
        again = _ask(http, "chat-qwen")  # started afresh
    finally:
        stop.set()
        asker.join()
    assert errors == []
    assert again == _ask(http, "chat-qwen")
    assert _status(http)["chat-qwen"]["pid"] != victim
    assert 'reason="exited"' in http.get("/metrics").text


def test_a_model_that_cannot_load_is_a_500_naming_why_and_harms_no_other(server):
    _, http = server
    _ask(http, "chat-qwen")
    failed = http.post("/v1/completions", json={"model": "broken", "prompt": "x"})
    assert failed.status_code == 500
    message = failed.json()["error"]["message"]
    assert "could not load the model" in message and "model broken exited" in message
    assert _status(http)["broken"]["value"] == "unloaded"
    assert _ask(http, "chat-qwen")  # still served
    assert 'llmserve_router_model_load_failures_total{model="broken"} 1.0' in \
        http.get("/metrics").text


def test_keep_alive_and_the_load_and_unload_routes(server):
    _, http = server
    loaded = http.post("/models/load", json={"model": "chat-llama"})
    assert loaded.status_code == 200 and loaded.json()["status"] == {"value": "loaded"}
    # an Ollama request with keep_alive 0 and nothing to answer unloads at once
    gone = http.post("/api/generate", json={"model": "chat-llama:latest", "keep_alive": 0})
    assert gone.json()["done_reason"] == "unload"
    assert "chat-llama" not in _loaded(http)
    # with something to answer: answered, then unloaded once idle
    answer = http.post("/api/generate", json={"model": "chat-llama", "prompt": "Hi",
                                              "stream": False, "keep_alive": "0s",
                                              "options": {"num_predict": 3}})
    assert answer.status_code == 200 and answer.json()["done"]
    # it waited for its model to load: Ollama's load_duration says how long, in the total
    load = answer.json()["load_duration"]
    assert 0.5e9 < load < answer.json()["total_duration"]
    wait_for(lambda: "chat-llama" not in _loaded(http), 10, "keep_alive 0 did not unload")
    bad = http.post("/api/generate", json={"model": "chat-llama", "keep_alive": "soon"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]
    # a keep-alive in the past of a model: /api/ps says when it goes
    http.post("/api/generate", json={"model": "chat-llama", "keep_alive": "10m"})
    (row,) = [m for m in http.get("/api/ps").json()["models"] if m["name"] == "chat-llama:latest"]
    assert row["expires_at"] < "2318" and row["size"] > 0
    assert http.post("/models/unload", json={"model": "nope"}).status_code == 404


def test_the_ollama_client_streams_through(server):
    ollama = pytest.importorskip("ollama")
    _, http = server
    client = ollama.Client(host=str(http.base_url), timeout=120)
    question = [{"role": "user", "content": "Hello"}]
    chunks = list(client.chat(model="chat-qwen", messages=question, stream=True,
                              options={"temperature": 0, "num_predict": 6}))
    assert chunks[-1].done and len(chunks) > 2
    assert "".join(c.message.content for c in chunks) == _ask(http, "chat-qwen")
    names = {m.model for m in client.list().models}
    assert {"chat-llama:latest", "chat-qwen:latest", f"{EMBED_MODEL}:latest"} <= names
    vectors = client.embed(model=EMBED_MODEL, input=["a", "b"]).embeddings
    assert len(vectors) == 2 and len(vectors[0]) == 64


def test_the_chat_page_picks_among_the_models(server, page):  # noqa: F811
    _, http = server
    _open(page, str(http.base_url))
    labels = page.eval_on_selector("#model", "el => [...el.options].map(o => o.text)")
    assert "chat-llama (unloaded)" in labels or "chat-llama (loaded)" in labels
    page.select_option("#model", "chat-qwen")
    bodies = _chat_requests(page)
    _send(page, "Hello", max_tokens=4)
    _wait_answered(page)
    assert bodies[-1]["model"] == "chat-qwen"
    assert "chat-qwen" in _loaded(http)


# ---- its parts ----------------------------------------------------------------------


def test_the_folder_is_read_as_models(tmp_path, models_dir):
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(b"")
    (tmp_path / "m-00002-of-00002.gguf").write_bytes(b"")
    (tmp_path / "mmproj-m.gguf").write_bytes(b"")
    (tmp_path / ".hidden.gguf").write_bytes(b"")
    found = find_models(tmp_path, cache_dir=tmp_path / "empty-cache")
    assert found == {}  # the empty first part is not a GGUF file: left out, with a warning
    found = find_models(models_dir, cache_dir=tmp_path / "empty-cache")
    assert set(found) == {*CHAT_MODELS, EMBED_MODEL, "broken"}
    assert found[EMBED_MODEL].flags == ("--runner", "pooling")
    assert found["chat-llama"].flags == ()
    assert lookup(found, "chat-llama:latest") is found["chat-llama"]
    assert lookup(found, "chat-llama:7b") is None


def test_a_sequence_classifier_runs_the_pooling_runner_as_a_classifier(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForSequenceClassification"]}))
    assert engine_flags(tmp_path) == ("--runner", "pooling", "--convert", "classify")


def test_a_models_server_takes_its_own_flags_out_of_each_models_command():
    argv = ["serve", "--models-dir", "d", "--max-loaded-models=2", "--keep-alive", "1m",
            "--pin", "a", "--threads", "1", "--max-loaded-memory", "4GiB"]
    assert without_flags(argv, ROUTER_FLAGS) == ["serve", "--threads", "1"]


def test_settings_refuse_what_cannot_be_served(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        ModelServerSettings(tmp_path, (), max_loaded=0)
    with pytest.raises(ValueError, match="no such folder"):
        ModelServerSettings(tmp_path / "missing", ())
    with pytest.raises(ValueError, match="pinned"):
        ModelServerSettings(tmp_path, (), max_loaded=1, pinned=("a", "b"))


@pytest.mark.parametrize("flag", [["--model", "x"], ["--served-model-name", "x"],
                                  ["--data-parallel-size", "2"]])
def test_flags_that_name_one_model_are_refused_beside_models_dir(tmp_path, flag):
    from llmserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--models-dir", str(tmp_path), *flag])
    assert exit_.value.code == 2
