"""The browser pages of `edgellm serve` (issue: a page to chat and to watch the engine), driven in headless
Chromium (Debian's `chromium`, which .ci/run installs) through Playwright with its executable_path, or, when
EDGELLM_TEST_BROWSER_CDP names one, a Chromium already running with remote debugging (.ci/arm: Chromium aborts under
qemu-user, so the aarch64 run drives the host's browser; the server and the pages under test run on aarch64).

Every request a page makes is checked: anything not to the loopback server fails the test. Screenshots go to
tests/artifacts/webui/."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from server_thread import ServerThread
from test_server import KEY

from edgellm.server.app import create_app
from timing import scaled

ARTIFACTS = Path(__file__).parent / "artifacts" / "webui"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    cdp = os.environ.get("EDGELLM_TEST_BROWSER_CDP")
    with sync_playwright() as p:
        if cdp:  # a browser started elsewhere (its contexts are ours; it is not closed here)
            b = p.chromium.connect_over_cdp(cdp, timeout=scaled(60) * 1000)
            yield b
            return
        exe = shutil.which("chromium") or "/usr/bin/chromium"
        assert os.path.exists(exe), "headless Chromium is needed: apt-get install chromium (.ci/run does)"
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(gemma_server):
    return gemma_server


@pytest.fixture(scope="module")
def keyed(gemma_llm):
    s = ServerThread(create_app(gemma_llm, api_key=KEY))
    yield s
    s.stop()


class Pages:
    """A browser context whose requests are all recorded; non-loopback ones are aborted and counted."""

    def __init__(self, browser):
        # bypass_csp: the pages forbid eval, which Playwright's wait_for_function needs (the route check below
        # is what keeps the pages on loopback in this test)
        self.ctx = browser.new_context(viewport={"width": 1100, "height": 760}, bypass_csp=True)
        self.outside: list[str] = []
        self.seen: list[str] = []
        self.ctx.route("**/*", self._route)

    def _route(self, route):
        url = route.request.url
        self.seen.append(url)
        if urlparse(url).hostname not in LOOPBACK:
            self.outside.append(url)
            return route.abort()
        return route.continue_()

    def new(self):
        return self.ctx.new_page()

    def close(self):
        self.ctx.close()
        assert not self.outside, f"the page tried to reach other hosts: {self.outside}"
        assert self.seen, "no request was routed (the check saw nothing)"


def wait_for(cond, timeout=scaled(60.0), what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def kv_used(server, headers=None) -> int:
    return httpx.get(server.url + "/api/dashboard", headers=headers or {}).json()["kv"]["used"]


def set_field(page, sel, value):
    page.fill(sel, str(value))
    page.dispatch_event(sel, "change")


def test_chat_streams_stops_and_keeps_the_conversation(browser, server):
    pages = Pages(browser)
    page = pages.new()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent.includes('context')")
    page.click("#toggle-settings")
    set_field(page, "#temperature", 0)
    set_field(page, "#max_tokens", 24)
    page.click("#toggle-settings")
    page.fill("#input", "Hello, who are you?")
    page.click("#send")
    page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=120_000)
    first = page.inner_text(".msg.assistant")
    assert first.strip() and "Error" not in first
    page.screenshot(path=str(ARTIFACTS / "chat_answer.png"))

    # a long answer, stopped mid-way: the server's KV blocks in use go back to 0
    page.click("#toggle-settings")
    set_field(page, "#max_tokens", 1500)
    page.click("#toggle-settings")
    page.fill("#input", "Write a very long story about a lighthouse keeper.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1].innerText.length > 40", timeout=120_000)
    assert kv_used(server) > 0
    page.click("#stop")
    page.wait_for_function("document.getElementById('status').textContent === 'stopped'", timeout=30_000)
    wait_for(lambda: kv_used(server) == 0, 15, "KV blocks in use to return to 0 after stop")
    stopped = page.locator(".msg.assistant").nth(1).inner_text()
    page.screenshot(path=str(ARTIFACTS / "chat_stopped.png"))

    # reload: the conversation is kept in local storage
    page.reload()
    page.wait_for_function("document.querySelectorAll('.msg').length === 4")
    assert page.locator(".msg.user").first.inner_text() == "Hello, who are you?"
    assert page.locator(".msg.assistant").nth(1).inner_text() == stopped
    page.screenshot(path=str(ARTIFACTS / "chat_reloaded.png"))
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    pages.close()


def test_markdown_is_rendered_and_raw_html_is_not(browser, server):
    pages = Pages(browser)
    page = pages.new()
    page.goto(server.url + "/")
    page.evaluate("""() => { localStorage.setItem('edgellm.chat', JSON.stringify({settings: {system: '',
        temperature: 0, top_p: 1, max_tokens: 8}, messages: [{role: 'user', content: 'x'}, {role: 'assistant',
        content: '<think>plan</think>**bold** and\\n\\n```py\\nprint(1)\\n```\\n<img src=x onerror=alert(1)>'}]})); }""")
    page.reload()
    msg = page.locator(".msg.assistant")
    assert msg.locator("strong").inner_text() == "bold"
    assert msg.locator("pre code").inner_text().strip() == "print(1)"
    assert msg.locator("details summary").inner_text() == "Reasoning"  # reasoning folded
    assert msg.locator("img").count() == 0  # the model's HTML is shown as text
    pages.close()


def test_dashboard_shows_a_running_request(browser, server):
    pages = Pages(browser)
    page = pages.new()
    done = threading.Event()

    def stream():
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=scaled(120)) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        wait_for(lambda: httpx.get(server.url + "/api/dashboard").json()["running"] >= 1, 60, "a running request")
        page.goto(server.url + "/dashboard")
        page.wait_for_function("+document.getElementById('running').textContent >= 1", timeout=30_000)
        page.wait_for_function("+document.getElementById('kv-used-n').textContent > 0")
        page.wait_for_function("document.getElementById('decode-tps').textContent !== '–'")
        page.screenshot(path=str(ARTIFACTS / "dashboard_running.png"))
    finally:
        done.set()
        t.join(60)
    wait_for(lambda: kv_used(server) == 0, 30, "blocks back after the stream")
    d = httpx.get(server.url + "/api/dashboard").json()
    assert d["ttft_ms"]["n"] >= 1 and d["ttft_ms"]["p50"] > 0 and d["itl_ms"]["n"] > 0
    assert d["kv"]["used"] + d["kv"]["free"] == d["kv"]["total"]
    pages.close()


def test_api_key_locks_the_data_and_the_page_says_so(browser, keyed):
    assert httpx.get(keyed.url + "/api/dashboard").status_code == 401
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert httpx.get(keyed.url + "/").status_code == 200  # the page itself holds no data
    pages = Pages(browser)
    page = pages.new()
    page.goto(keyed.url + "/")
    page.wait_for_selector("#key-panel.open")
    assert "401" in page.inner_text("#key-message")
    page.screenshot(path=str(ARTIFACTS / "chat_locked.png"))
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_function("document.getElementById('model-name').textContent.includes('context')")
    page.goto(keyed.url + "/dashboard")  # the key is kept for the dashboard too
    page.wait_for_function("document.getElementById('state').textContent.startsWith('live')")
    page.evaluate("localStorage.removeItem('edgellm.key')")
    page.reload()
    page.wait_for_function("document.getElementById('state').textContent.includes('401')")
    pages.close()


def test_no_webui_leaves_the_pages_out(gemma_llm):
    s = ServerThread(create_app(gemma_llm, webui=False))
    try:
        root = httpx.get(s.url + "/")  # without the chat page the root is Ollama's liveness answer
        assert root.status_code == 200 and root.text.strip('"') == "Ollama is running" and "<html" not in root.text
        assert httpx.get(s.url + "/dashboard").status_code == 404
        assert httpx.get(s.url + "/api/dashboard").status_code == 404
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()
