"""`llmserve run-batch`: OpenAI Batch files through the server's handlers, offline.

The CLI runs in-process on the default model; the bodies are compared with a real server's
answers to the same requests.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from llmserve.engine.async_engine import AsyncEngine
from llmserve.entrypoints.cli import main
from tests.entrypoints.openai.conftest import run_server

MODEL = "smollm2-test"
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", "512")
NUM_LINES = 100
WORDS = ("cat", "river", "moon", "bread", "train", "garden", "storm", "violin", "city", "salt")


def _valid_line(i: int) -> dict[str, Any]:
    """Chat on even lines, completions on odd ones; greedy, a few tokens, some logprobs."""
    word = WORDS[i % len(WORDS)]
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 1 + i % 8}
    if i % 2 == 0:
        body["messages"] = [{"role": "user", "content": f"Say something about a {word}."}]
        url = "/v1/chat/completions"
        if i % 4 == 0:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = f"Once upon a time, a {word} {i}"
        url = "/v1/completions"
        if i % 3 == 0:
            body.update(logprobs=2, n=2)
    if i == 1:
        body["foo"] = "bar"  # unknown fields are ignored, as by the server
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


# the bad line at position i (i % 10 >= 6), its custom_id in the output and the error
# expected: ("line", code) for `error`, (status, param) for an error `response`
def _bad_line(i: int) -> tuple[str, str | None, tuple]:
    kind = i % 10
    if kind == 6:
        return '{"custom_id": "cut', None, ("line", "invalid_json")
    if kind == 7:
        line = _valid_line(i)
        del line["custom_id"]
        return json.dumps(line), None, ("line", "missing_custom_id")
    if kind == 8:
        return json.dumps(_valid_line(i - 8)), f"req-{i - 8}", ("line", "duplicate_custom_id")
    line = _valid_line(i)
    variant = (i // 10) % 5
    if variant == 0:
        line["url"] = "/v1/embeddings"
        expected = (400, "url")
    elif variant == 1:
        line["method"] = "GET"
        expected = (400, "method")
    elif variant == 2:
        line["body"]["temperature"] = -1
        expected = (400, "temperature")
    elif variant == 3:
        line["body"]["max_tokens"] = 100_000
        expected = (400, "max_tokens")
    else:
        line["body"]["messages" if "messages" in line["body"] else "prompt"] = 42
        expected = (400, "messages" if "messages" in line["body"] else "prompt")
    return json.dumps(line), line["custom_id"], expected


def _batch() -> tuple[list[str], list[tuple[str | None, Any]]]:
    """The input lines and, per line, (custom_id, expected: "ok" or an error as above)."""
    texts, expected = [], []
    for i in range(NUM_LINES):
        if i % 10 < 6:
            texts.append(json.dumps(_valid_line(i)))
            expected.append((f"req-{i}", "ok"))
        else:
            text, custom_id, error = _bad_line(i)
            texts.append(text)
            expected.append((custom_id, error))
    return texts, expected


class _CountRequests:
    """Counts the requests the engine is asked to admit."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        add_request = AsyncEngine.add_request

        async def counted(engine: AsyncEngine, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await add_request(engine, *args, **kwargs)

        monkeypatch.setattr(AsyncEngine, "add_request", counted)


def _run(gguf: Path, src: Path, out: str, *extra: str) -> int:
    return main(["run-batch", "--model", str(gguf), "-i", str(src), "-o", out,
                 "--served-model-name", MODEL, *ENGINE_FLAGS, *extra])


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(smollm2_gguf, tmp_path_factory) -> tuple[Path, Path, list, int]:
    """The batch run once: (input, output, expectations, engine requests)."""
    folder = tmp_path_factory.mktemp("batch")
    texts, expected = _batch()
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_text("\n".join(texts) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        counter = _CountRequests(mp)
        assert _run(smollm2_gguf, src, str(out), "--max-concurrency", "16") == 0
    return src, out, expected, counter.count


def test_one_result_per_line_in_order_with_errors(first_run):
    _, out, expected, num_requests = first_run
    records = _read(out)
    assert len(records) == NUM_LINES
    for i, (record, (custom_id, want)) in enumerate(zip(records, expected, strict=True)):
        assert record["custom_id"] == custom_id, i
        assert record["id"].startswith("batch_req_")
        if want == "ok":
            response = record["response"]
            assert record["error"] is None and response["status_code"] == 200, record
            body = response["body"]
            assert response["request_id"] == body["id"]
            assert body["model"] == MODEL
            assert len(body["choices"]) == (2 if i % 6 == 3 else 1)
        elif want[0] == "line":
            assert record["response"] is None, record
            assert record["error"]["code"] == want[1], record
        else:
            status, param = want
            assert record["error"] is None
            assert record["response"]["status_code"] == status, record
            assert record["response"]["body"]["error"]["param"] == param, record
    # every valid line, and the max_tokens lines the engine itself refuses
    num_ok = sum(want == "ok" for _, want in expected)
    num_too_long = sum(want == (400, "max_tokens") for _, want in expected)
    assert num_requests == num_ok + num_too_long


def test_bodies_equal_the_servers(first_run, smollm2_gguf, float32_model):
    src, out, expected, _ = first_run
    records = _read(out)
    # the first valid lines, and every body the handlers or the engine refuse
    chosen = [i for i, (_, want) in enumerate(expected)
              if (want == "ok" and i < 12) or want in ((400, "temperature"),
                                                         (400, "max_tokens"), (400, "prompt"))]
    texts = src.read_text().splitlines()
    with run_server(smollm2_gguf, float32_model) as server, server.http() as http:
        for i in chosen:
            line = json.loads(texts[i])
            response = http.post(line["url"], json=line["body"])
            got = records[i]["response"]
            assert got["status_code"] == response.status_code, line
            _assert_same_body(got["body"], response.json())


def _assert_same_body(batch: dict[str, Any], server: dict[str, Any]) -> None:
    if "error" in server:
        assert batch == server
        return
    for key in ("object", "model", "prompt_logprobs"):
        assert batch.get(key) == server.get(key)
    # a shared prompt prefix may be cached in one engine and not in the other
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == server["usage"][key]
    assert len(batch["choices"]) == len(server["choices"])
    for mine, theirs in zip(batch["choices"], server["choices"], strict=True):
        mine_lp, theirs_lp = mine.pop("logprobs"), theirs.pop("logprobs")
        assert mine == theirs  # text or message, finish and stop reasons, index
        assert _tokens(mine_lp) == _tokens(theirs_lp)
        assert _values(mine_lp) == pytest.approx(_values(theirs_lp), abs=1e-4)


def _tokens(logprobs: dict | None) -> list | None:
    if logprobs is None:
        return None
    if "content" in logprobs:
        return [(e["token"], [t["token"] for t in e["top_logprobs"]])
                for e in logprobs["content"]]
    return [logprobs["tokens"], [sorted(t) for t in logprobs["top_logprobs"]]]


def _values(logprobs: dict | None) -> list[float]:
    if logprobs is None:
        return []
    if "content" in logprobs:
        return [e["logprob"] for e in logprobs["content"]]
    return logprobs["token_logprobs"]


def test_resume_recomputes_only_the_missing_lines(first_run, smollm2_gguf, monkeypatch,
                                                  tmp_path, capsys):
    src, out, expected, _ = first_run
    before = _read(out)
    ok_dropped = [3, 4, 11, 50]  # two chats, two completions
    dropped = {*ok_dropped, 6, 29}  # and bad JSON (a line error), temperature -1 (a 400)
    assert expected[29][1] == (400, "temperature")
    partial = tmp_path / "out.jsonl"
    kept = [r for i, r in enumerate(before) if i not in dropped]
    kept.reverse()  # resuming does not depend on the order left behind
    partial.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"custom_id": "req-5"')
    counter = _CountRequests(monkeypatch)
    assert _run(smollm2_gguf, src, str(partial), "--no-progress") == 0
    assert counter.count == len(ok_dropped)
    num_kept = len(kept) - sum(r["response"] is None for r in kept)
    assert f"60 ok, 40 errors ({num_kept} from an earlier run)" in capsys.readouterr().err
    after = _read(partial)
    assert len(after) == NUM_LINES
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if i not in dropped and old["response"] is None:
            assert {**new, "id": None} == {**old, "id": None}, i  # judged again, the same
            continue
        if i not in dropped:
            assert new == old, i  # kept as it was
            continue
        assert new["custom_id"] == old["custom_id"] and new["id"] != old["id"]
        if old["response"] is None:
            assert new["response"] is None and new["error"] == old["error"]
        else:
            assert new["response"]["status_code"] == old["response"]["status_code"]
            assert _choice_texts(new) == _choice_texts(old)



    def no_engine(*_: Any, **__: Any) -> None:
        raise AssertionError("nothing is left to run, yet the model was loaded")

    monkeypatch.setattr("llmserve.engine.engine.Engine", no_engine)
    assert _run(smollm2_gguf, src, str(partial), "--no-progress") == 0
    assert [r["id"] for r in _read(partial) if r["response"]] == [
        r["id"] for r in after if r["response"]]


def _choice_texts(record: dict[str, Any]) -> list[str] | dict:
    body = record["response"]["body"]
    if "error" in body:
        return body
    return [c.get("text") or c["message"]["content"] for c in body["choices"]]


def test_stdout(smollm2_gguf, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_valid_line(2)) + "\nnot json\n\n" + json.dumps(_valid_line(3)))
    assert _run(smollm2_gguf, src, "-", "--no-progress") == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["custom_id"] for r in records] == ["req-2", None, "req-3"]
    assert [r["response"] and r["response"]["status_code"] for r in records] == [200, None, 200]
    assert "2 ok, 1 errors;" in captured.err


def test_served_model_name_is_checked(smollm2_gguf, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = _valid_line(1)
    line["body"]["model"] = "gpt-4"
    src.write_text(json.dumps(line) + "\n")
    assert _run(smollm2_gguf, src, str(out), "--no-progress") == 0
    (record,) = _read(out)
    assert record["response"]["status_code"] == 404
    assert record["response"]["body"]["error"]["code"] == "model_not_found"


def test_usage_errors(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["run-batch", "-i", "x.jsonl"])
    assert exit_info.value.code == 2
    (tmp_path / "empty.jsonl").write_text("\n")
    assert main(["run-batch", "-i", str(tmp_path / "empty.jsonl"), "-o", "-"]) == 1
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", "-"]) == 1
