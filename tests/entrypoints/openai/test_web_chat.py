"""The chat page at / in headless Chromium against a real server: answers stream in with
their TTFT and speed, Stop aborts the request on the server, model output is shown as text
(never as HTML), and the page works on a server with an API key.

Chromium is the system one (/usr/bin/chromium, Debian's `chromium`; .ci/run installs it),
driven by Playwright's Python package. Without it the browser tests skip on a developer's
machine and fail in CI (CI set), so a CI run cannot pass them by skipping.
"""

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import MODEL, run_server, wait_engine_idle
from tests.entrypoints.openai.test_metrics import scrape, value

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parents[2] / "artifacts"
API_KEY = "page-test-key"
STATS = re.compile(r"TTFT (\d+ ms|[\d.]+ s) · ([\d.]+) tok/s · (\d+) tokens")
# a short answer may arrive in one network read: then no decode time, so no tok/s
ANSWERED = re.compile(r"TTFT (\d+ ms|[\d.]+ s)( · [\d.]+ tok/s)? · (\d+) tokens")

# Records each length the newest answer's text goes through, with its time.
WATCH_ANSWER_GROWTH = """() => {
  window.growth = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll(".message.assistant .body");
    const length = answers.length ? answers[answers.length - 1].textContent.length : 0;
    const last = window.growth.at(-1);
    if (length > 0 && last?.[1] !== length) window.growth.push([performance.now(), length]);
  }).observe(document.querySelector("#conversation"),
             {childList: true, subtree: true, characterData: true});
}"""


def _missing_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (pip install -e '.[test]')"
    return None


@contextmanager
def launched_browser() -> Iterator[object]:
    """The system Chromium under Playwright (skipped without it on a developer's machine,
    a failure in CI)."""
    missing = _missing_browser()
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                              args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with launched_browser() as chromium:
        yield chromium


@pytest.fixture
def page(browser):
    """A fresh page (its own localStorage); page errors fail the test."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


@pytest.fixture(scope="module")
def key_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, api_key=API_KEY) as running:
        yield running


def _wait_for(page, js: str, timeout_s: float = 30) -> None:
    """Poll `js` in the page until it is true (`wait_for_function` evaluates its predicate
    from a string, which the page's Content-Security-Policy forbids)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(js):
        assert time.monotonic() < deadline, f"timed out waiting for {js}"
        time.sleep(0.02)


def _open(page, url: str) -> None:
    """Load the page and wait for its model list; greedy sampling, so answers repeat."""
    page.goto(url)
    _wait_for(page, "document.querySelector('#model').options.length > 0")
    _set_range(page, "#temperature", 0)


def _set_range(page, selector: str, value: float) -> None:
    page.eval_on_selector(selector, "(el, v) => { el.value = v; "
                          "el.dispatchEvent(new Event('input')); }", str(value))


def _send(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _wait_answered(page, timeout_s: float = 60) -> str:
    page.wait_for_selector("#send:not([hidden])", timeout=timeout_s * 1000)
    return page.locator(".message.assistant .stats").last.inner_text()


def _chat_requests(page) -> list[dict]:
    """The bodies the page sends to /v1/chat/completions from now on, as they go."""
    bodies = []

    def record(request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            bodies.append(json.loads(request.post_data))

    page.on("request", record)
    return bodies


def _abort_count(server) -> float:
    families = scrape(server)
    samples = families.get("llmserve_request_success", {})
    return samples.get(("llmserve_request_success_total", (("finished_reason", "abort"),)), 0)


def test_answer_streams_in_with_its_ttft_and_speed(server, page):
    _open(page, server.url)
    assert page.locator("#model option").all_inner_texts() == [MODEL]
    sent = _chat_requests(page)
    page.fill("#system", "You are a helpful assistant.")
    _set_range(page, "#top-p", 0.9)
    page.evaluate(WATCH_ANSWER_GROWTH)
    _send(page, "Write a short Python function that adds two numbers.", max_tokens=48)
    stats = _wait_answered(page)

    assert sent == [{
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0, "top_p": 0.9, "max_tokens": 48,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user",
                      "content": "Write a short Python function that adds two numbers."}]}]
    growth = page.evaluate("window.growth")
    # the text grew in steps over time, not in one paint (a step may shrink it a little:
    # "**" or a fence line turns into markup once its closing half arrives)
    assert len(growth) >= 5 and growth[-1][1] > 2 * growth[0][1], growth
    assert growth[-1][0] - growth[0][0] > 100, growth
    match = STATS.fullmatch(stats)
    assert match, f"no TTFT / tok/s line under the answer: {stats!r}"
    assert float(match[2]) > 0 and 1 < int(match[3]) <= 48
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_chat.png"))


def test_stop_ends_the_answer_and_aborts_the_request_on_the_server(server, page):
    _open(page, server.url)
    sent = _chat_requests(page)
    _send(page, "Say hello.", max_tokens=8)
    _wait_answered(page)
    first_answer = page.locator(".message.assistant .body").first.inner_text()

    # the model may end its answer early: it runs to max_tokens here (a test-only field)
    def ignore_eos(route):
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data),
                                              "ignore_eos": True}))

    page.route("**/v1/chat/completions", ignore_eos)
    aborted_before = _abort_count(server)
    _send(page, "Write a long essay about the sea.", max_tokens=400)
    answer = page.locator(".message.assistant .body").last
    _wait_for(page, "document.querySelectorAll('.message.assistant .body')[1]"
                    ".textContent.length > 40")
    assert value(scrape(server), "num_requests_running") == 1
    page.click("#stop")
    stats = _wait_answered(page, timeout_s=5)
    stopped_at = len(answer.inner_text())

    # Stop aborted the request on the server: it ends as an abort, long before its 400
    # tokens (a request left running would end as "length")
    page.wait_for_load_state("networkidle")  # nothing more arrives for the answer
    wait_engine_idle(server)
    families = scrape(server)
    assert value(families, "num_requests_running") == 0
    assert _abort_count(server) == aborted_before + 1
    assert len(answer.inner_text()) == stopped_at, "the answer grew after Stop"
    match = re.fullmatch(STATS.pattern + " · stopped", stats)
    assert match and int(match[3]) < 400, stats
    # the second request carried the first exchange as history
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][1]["content"] == first_answer


# Markdown whose text holds markup at every level the renderer knows, split mid-tag.
HOSTILE_ANSWER = (
    '# Title <img src=x onerror="window.pwned=1">\n'
    "Some **bold <script>window.pwned=2</script>** and `<b>code</b>` and *it <i>x</i>*.\n"
    '- item <iframe src="javascript:window.pwned=3"></iframe>\n'
    "1. <svg onload=window.pwned=4></svg>\n\n"
    '```html\n<img src=x onerror="window.pwned=5">\n```\n'
)
ALLOWED_TAGS = {"H2", "P", "STRONG", "EM", "CODE", "UL", "OL", "LI", "PRE", "SPAN"}


def _sse_body(text: str, piece: int = 7) -> str:
    chunks = [{"choices": [{"index": 0, "delta": {"content": text[i:i + piece]}}]}
              for i in range(0, len(text), piece)]
    chunks.append({"choices": [], "usage": {"completion_tokens": len(chunks)}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_model_output_is_shown_as_text_never_as_html(server, page):
    _open(page, server.url)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=_sse_body(HOSTILE_ANSWER)))
    _send(page, "Say something nasty.", max_tokens=64)
    _wait_answered(page)
    page.wait_for_load_state("networkidle")  # an <img>'s error, had one been made, has fired

    body = page.locator(".message.assistant .body")
    tags = set(body.evaluate("b => [...b.querySelectorAll('*')].map(e => e.tagName)"))
    assert tags <= ALLOWED_TAGS, f"model output made elements {tags - ALLOWED_TAGS}"
    assert page.evaluate("window.pwned") is None
    text = body.inner_text()
    for markup in ('<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>",
                   "<b>code</b>", '<iframe src="javascript:window.pwned=3"></iframe>',
                   "<svg onload=window.pwned=4></svg>", '<img src=x onerror="window.pwned=5">'):
        assert markup in text
    # and the Markdown around it is still rendered
    assert body.locator("h2").inner_text() == 'Title <img src=x onerror="window.pwned=1">'
    assert body.locator("strong").inner_text() == "bold <script>window.pwned=2</script>"
    assert body.locator("p code").inner_text() == "<b>code</b>"
    assert body.locator("em").inner_text() == "it <i>x</i>"
    assert body.locator("ul li").count() == 1 and body.locator("ol li").count() == 1
    assert body.locator("pre code").inner_text() == '<img src=x onerror="window.pwned=5">'


def test_reasoning_is_shown_collapsed_as_text_and_kept_out_of_the_history(server, page):
    _open(page, server.url)
    sent = _chat_requests(page)
    thinking = "The user greets me. <b>Be</b> brief."
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": thinking[i:i + 9]}}]}
              for i in range(0, len(thinking), 9)]
    chunks += [{"choices": [{"index": 0, "delta": {"content": "Hello **there**!"}}]},
               {"choices": [], "usage": {"completion_tokens": len(chunks) + 1}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=body))
    _send(page, "Hi!", max_tokens=16)
    _wait_answered(page)
    reasoning = page.locator(".message.assistant details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # collapsed
    assert reasoning.locator(".thought").text_content() == thinking  # as text, not HTML
    assert reasoning.locator(".thought *").count() == 0
    assert page.locator(".message.assistant .body strong").inner_text() == "there"
    page.unroute("**/v1/chat/completions")
    _send(page, "And again?", max_tokens=2)
    _wait_answered(page)
    assert sent[1]["messages"][:3] == [  # the answer went back without its reasoning
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello **there**!"},
        {"role": "user", "content": "And again?"}]
    # an answer without reasoning shows none
    assert page.locator(".message.assistant details.reasoning").last.is_hidden()


def test_a_reasoning_servers_thinking_streams_into_the_page(smollm2_gguf, loaded_model,
                                                            page):
    """deepseek_r1: the answer opens in reasoning, and SmolLM2 never closes it, so its
    whole greedy output is reasoning, the same text the API gives."""
    with run_server(smollm2_gguf, loaded_model, reasoning_parser="deepseek_r1") as running:
        _open(page, running.url)
        _send(page, "Hi!", max_tokens=12)
        _wait_answered(page)
        reply = running.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=12,
            temperature=0, top_p=0.95)
    thought = page.locator(".message.assistant details.reasoning .thought").last
    assert thought.text_content() == reply.choices[0].message.reasoning_content != ""


def test_a_refused_request_shows_the_servers_message(server, page):
    _open(page, server.url)
    sent = _chat_requests(page)
    _send(page, "Hi!", max_tokens=100_000)
    assert "lower max_tokens to" in _wait_answered(page)
    assert page.locator(".message.assistant.failed").count() == 1
    _send(page, "Hi again!", max_tokens=4)  # the refused question left the history
    assert ANSWERED.fullmatch(_wait_answered(page))
    assert sent[1]["messages"] == [{"role": "user", "content": "Hi again!"}]


def test_page_asks_for_the_key_on_a_server_with_one(key_server, page):
    page.goto(key_server.url)
    _wait_for(page, "document.querySelector('#notice').textContent.length > 0")
    assert "API key" in page.inner_text("#notice")
    assert page.locator("#model option").count() == 0

    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    _wait_for(page, "document.querySelector('#model').options.length > 0")
    assert page.inner_text("#notice") == ""
    _set_range(page, "#temperature", 0)
    _send(page, "Hi!", max_tokens=8)
    assert ANSWERED.fullmatch(_wait_answered(page))  # the API accepted the page's key

    _open(page, key_server.url)  # the key is remembered
    assert page.input_value("#api-key") == API_KEY


def test_page_and_assets_are_open_but_the_api_is_not(key_server):
    with httpx.Client(base_url=key_server.url, timeout=10) as http:
        page = http.get("/")
        assets = re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text) + ["/ui/markdown.js"]
        responses = {path: http.get(path) for path in assets}
        models = http.get("/v1/models")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert set(assets) == {"/ui/favicon.svg", "/ui/chat.css", "/ui/chat.js", "/ui/markdown.js"}
    assert {p: r.status_code for p, r in responses.items()} == dict.fromkeys(assets, 200)
    assert responses["/ui/chat.js"].headers["content-type"].startswith("text/javascript")
    assert models.status_code == 401
