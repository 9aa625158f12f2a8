"""Images on every API of a live server on a tiny random LLaVA: OpenAI's image_url parts
(whole and streamed), Anthropic image blocks, Ollama's `images`, the Responses API's
input_image — each the offline `LLM.chat` answer for the same image and text — and bad
images refused with a 400 naming the part while a normal chat beside them is answered."""

import base64
import io

import pytest
from PIL import Image

from llmserve import LLM, SamplingParams
from tests.entrypoints.openai.conftest import MODEL, run_server
from tests.models.test_llava_reference import random_image
from tests.tiny_models import save_tiny_llava

QUESTION = "What is in the picture?"


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


@pytest.fixture(scope="module")
def llava_llm(tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("llava-server")
    save_tiny_llava(folder, "clip")
    return LLM(str(folder), dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def vision_server(llava_llm):
    with run_server(llava_llm.engine.loaded.source.path, llava_llm.engine.loaded) as server:
        yield server


@pytest.fixture(scope="module")
def image() -> Image.Image:
    return random_image(7, 45, 60)


@pytest.fixture(scope="module")
def expected(llava_llm, image) -> str:
    """The offline chat's greedy answer to the picture and question."""
    (out,) = llava_llm.chat([{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].text


def chat_body(image_part: dict) -> dict:
    return {"model": MODEL, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                image_part, {"type": "text", "text": QUESTION}]}]}


def test_openai_image_url_whole_and_streamed(vision_server, image, expected, llava_llm):
    import openai

    client = openai.OpenAI(base_url=vision_server.base_url, api_key="x")
    part = {"type": "image_url", "image_url": {"url": data_url(image), "detail": "auto"}}
    body = chat_body(part)
    reply = client.chat.completions.create(**{k: v for k, v in body.items()
                                              if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected
    tokens_per_image = llava_llm.engine.loaded.config.vision.tokens_per_image
    assert reply.usage.prompt_tokens > tokens_per_image  # the image's rows are counted
    stream = client.chat.completions.create(
        **{k: v for k, v in body.items() if k != "ignore_eos"}, stream=True,
        extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_anthropic_image_block(vision_server, image, expected):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="x")
    message = client.messages.create(
        model=MODEL, max_tokens=10, extra_body={"temperature": 0, "ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(image)).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected


def test_ollama_images(vision_server, image, expected):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=vision_server.url, timeout=120)
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION,
                                                "images": [png(image)]}],
                        options={"temperature": 0, "num_predict": 10}, stream=False)
    # Ollama's chat stops at the end of text; the tiny model's 10 tokens never hit it
    assert reply.message.content == expected
    assert "vision" in client.show(MODEL).capabilities
    generated = client.generate(model=MODEL, prompt=QUESTION, images=[png(image)],
                                options={"temperature": 0, "num_predict": 10}, stream=False)
    assert generated.response == expected  # the same templated prompt
    # a context carries token ids, not the images they stood for: refused, not misread
    with pytest.raises(ollama.ResponseError, match="no image fills"):
        client.generate(model=MODEL, prompt="And now?", images=[png(image)],
                        context=generated.context, options={"num_predict": 4}, stream=False)


def test_responses_input_image(vision_server, image, expected):
    import openai

    client = openai.OpenAI(base_url=vision_server.base_url, api_key="x")
    response = client.responses.create(
        model=MODEL, max_output_tokens=10, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(image)},
            {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected


def bomb() -> bytes:
    """A 10,000 x 10,000 one-colour PNG: a few hundred KB that decode to 300 MB."""
    return png(Image.new("RGB", (10_000, 10_000), (10, 20, 30)))


@pytest.mark.parametrize("case", ["not an image", "truncated", "bomb", "http", "too many",
                                  "detail"])
def test_bad_images_are_refused_by_part_and_others_are_served(vision_server, image, expected,
                                                              case):
    import httpx

    good = data_url(image)
    parts = {
        "not an image": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"hello").decode()}}],
        "truncated": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png(image)[:200]).decode()}}],
        "bomb": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(bomb()).decode()}}],
        "http": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/a.png"}}],
        "too many": [{"type": "image_url", "image_url": {"url": good}}] * 17,
        "detail": [{"type": "image_url", "image_url": {"url": good, "detail": "high"}}],
    }[case]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": QUESTION}]}]}
    response = httpx.post(f"{vision_server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("messages"), error
    print(f"{case}: {error['message']} ({error['param']})")
    normal = httpx.post(f"{vision_server.base_url}/chat/completions", timeout=60,
                        json=chat_body({"type": "image_url", "image_url": {"url": good}}))
    assert normal.status_code == 200
    assert normal.json()["choices"][0]["message"]["content"] == expected


def test_a_text_model_refuses_an_image_naming_the_part(server):
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}]}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content[0]"
    assert "text only" in response.json()["error"]["message"]


def test_cli_chat_takes_images(llava_llm, image, expected, capsys):
    """`llmserve chat --image FILE`'s loop: the image goes with the first message."""
    from llmserve.entrypoints.cli.generation import chat_repl

    lines = iter([QUESTION])

    def read_line(_: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    chat_repl(llava_llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), None,
              read_line=read_line, images=[image])
    assert capsys.readouterr().out.strip() == expected.strip()


def test_the_chat_page_sends_an_image_and_streams_the_answer(vision_server, image, tmp_path):
    """In headless Chromium: Image attaches a file, its thumbnail shows, the message goes as
    an image_url part with the file's bytes, and the answer streams in."""
    from tests.entrypoints.openai.test_web_chat import (
        ANSWERED,
        _chat_requests,
        _open,
        _send,
        _wait_answered,
        _wait_for,
        launched_browser,
    )

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(image))
    with launched_browser() as browser:
        context = browser.new_context(viewport={"width": 1200, "height": 800})
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        _open(page, vision_server.url)
        sent = _chat_requests(page)
        page.set_input_files("#image-file", str(picture))
        _wait_for(page, "document.querySelectorAll('#attachments img').length === 1")
        _send(page, QUESTION, 10)
        stats = _wait_answered(page)
        assert ANSWERED.fullmatch(stats), stats
        assert page.locator(".message.user .images img").count() == 1
        assert page.locator("#attachments img").count() == 0  # sent with that message
        context.close()
    assert not errors, errors
    content = sent[0]["messages"][-1]["content"]
    assert content[0] == {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()}}
    assert content[1] == {"type": "text", "text": QUESTION}


@pytest.fixture(scope="module")
def image_host(image):
    """A local web server: /picture.png (the image), /elsewhere (a redirect to another
    host's name for the same server), /huge (over the byte cap)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from llmserve.multimodal.images import MAX_IMAGE_BYTES

    body = png(image)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            port = self.server.server_address[1]
            if self.path == "/picture.png":
                self._send(200, body)
            elif self.path == "/elsewhere":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/picture.png")
                self.end_headers()
            elif self.path == "/huge":
                self._send(200, b"\0" * (MAX_IMAGE_BYTES + 1))
            else:
                self._send(404, b"")

        def _send(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_image_urls_are_fetched_from_allowed_hosts_only(llava_llm, image_host, expected):
    import httpx

    def ask(server, url: str) -> httpx.Response:
        return httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                          json=chat_body({"type": "image_url", "image_url": {"url": url}}))

    loaded = llava_llm.engine.loaded
    with run_server(loaded.source.path, loaded, allowed_media_domains=("127.0.0.1",)) as s:
        fetched = ask(s, f"{image_host}/picture.png")
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["choices"][0]["message"]["content"] == expected
        for path, message in (("/elsewhere", "not in --allowed-media-domains"),
                              ("/huge", "over"), ("/missing", "HTTP 404")):
            refused = ask(s, f"{image_host}{path}")
            assert refused.status_code == 400, path
            error = refused.json()["error"]
            assert message in error["message"] and error["param"] == "messages[0].content[0]"
    with run_server(loaded.source.path, loaded) as s:  # by default no host is reached
        refused = ask(s, f"{image_host}/picture.png")
        assert refused.status_code == 400
        assert "--allowed-media-domains" in refused.json()["error"]["message"]


def test_bench_vision_times_text_streams_beside_image_chats(vision_server):
    """`llmserve bench vision --beside`: the text streams' tokens a second, gaps and the
    longest time none got text, alone and beside the image chats, and the images' TTFT."""
    from llmserve.bench.vision import VisionBenchConfig, format_vision_bench, run_vision_bench

    report = run_vision_bench(VisionBenchConfig(
        vision_server.url, MODEL, streams=(1,), requests_per_stream=1, output_len=4,
        image_side=64, beside=2, beside_images=2, beside_alone_s=1.0))
    assert report["runs"][0]["requests"] == 1 and report["runs"][0]["output_tokens"] == 4
    beside = report["beside"]
    assert beside["text_streams"] == 2 and len(beside["image_ttft_s"]) == 2
    for phase in ("alone", "beside"):
        figures = beside[phase]
        assert figures["text_tok_s"] > 0 and figures["gap_p50_ms"] > 0
        assert 0 < figures["gap_p50_ms"] <= figures["gap_max_ms"]
        assert 0 < figures["silence_max_ms"] <= 1000 * figures["seconds"]
    assert "no text, max ms" in format_vision_bench(report)
