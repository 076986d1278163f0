"""The web pages in a real browser: Debian's chromium, driven by Playwright, against the SmolLM2 server (one server
with an API key and one browser for the whole file).

Screenshots go to $COBATCH_SCREENSHOTS (default: a new temporary folder); with COBATCH_DOCS_SCREENSHOTS=1 the chat
and the dashboard are also saved as docs/webui-chat.png and docs/webui-dashboard.png, the README's pictures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import RawStream, live_server, wait_for



def _chromium() -> str | None:
    """Debian's chromium. .ci/run installs it while the tests run and names, in COBATCH_CHROMIUM_INSTALLED, the
    file the install writes when it has ended (installed or not): these tests wait for that file first."""
    flag = os.environ.get("COBATCH_CHROMIUM_INSTALLED")
    deadline = time.monotonic() + 600
    while flag and not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.5)
    return shutil.which("chromium") or shutil.which("chromium-browser")

KEY = "webui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOCS = Path(__file__).resolve().parents[1] / "docs"
WAIT_MS = 60_000          # the CPU path on a busy machine: a few tokens a second
QUESTION = "What is the capital of France?"
expect.set_options(timeout=WAIT_MS)
FOR_README = os.environ.get("COBATCH_DOCS_SCREENSHOTS") == "1"


@pytest.fixture(scope="module")
def server():
    with live_server(load_llm("smollm2"), ServerOptions(api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium executable on PATH (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots():
    folder = Path(os.environ.get("COBATCH_SCREENSHOTS") or tempfile.mkdtemp(prefix="cobatch-webui-"))
    folder.mkdir(parents=True, exist_ok=True)

    def save(page, name: str, readme: bool = False) -> None:
        page.screenshot(path=folder / f"{name}.png")
        if readme and FOR_README:
            shutil.copyfile(folder / f"{name}.png", DOCS / f"{name}.png")
    return save


@pytest.fixture(scope="module")
def shared_page(browser, server):
    """One page for every test (each new page starts a renderer process: about a second of CPU)."""
    context = browser.new_context(base_url=server.url, viewport={"width": 1280, "height": 800})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    yield page
    context.close()


@pytest.fixture
def page(shared_page):
    """The shared page with a clean slate: no conversation, and the API key as if entered before
    (test_api_key_is_asked_for_and_kept enters it through the form)."""
    shared_page.goto("/webui/style.css")        # this origin, to reach its localStorage
    shared_page.evaluate(f"localStorage.clear(); localStorage.setItem('cobatch.apiKey', {json.dumps(KEY)})")
    yield shared_page
    errors, shared_page.errors[:] = list(shared_page.errors), []
    assert errors == [], errors                 # no uncaught script error on any page


def test_api_key_is_asked_for_and_kept(page, server, shots):
    page.evaluate("localStorage.removeItem('cobatch.apiKey')")
    page.goto("/")
    form = page.locator("#key-form")
    expect(form).to_be_visible()
    expect(form.locator(".key-message")).to_have_text("This server needs an API key.")
    form.locator("input").fill("not-the-key")
    form.locator("button").click()
    expect(form.locator(".key-message")).to_contain_text("refused this API key (invalid API key)")
    shots(page, "webui-api-key")
    form.locator("input").fill(KEY)
    form.locator("button").click()
    expect(form).to_be_hidden()
    expect(page.locator("#model")).to_have_text(server.context.model_name)
    assert page.evaluate("localStorage.getItem('cobatch.apiKey')") == KEY
    page.reload()                                   # kept in the browser: not asked again
    expect(page.locator("#model")).to_have_text(server.context.model_name)
    expect(form).to_be_hidden()
    page.goto("/dashboard")                         # the same origin's pages share it
    expect(page.locator("#status")).to_have_text("live")


def _stats(page) -> str:
    return page.locator(".message.assistant .stats").last.inner_text()


def test_chat_streams_an_answer_then_regenerates_it(page, server, shots):
    requests: list[str] = []

    def count(request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            requests.append(request.url)
    page.on("request", count)
    page.goto("/")
    expect(page.locator("#model")).to_have_text(server.context.model_name)
    page.fill("#system", "You are a concise geography tutor.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#dry-multiplier", "0.8")          # a sampler the request carries (greedy stays greedy)
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    # Every text the answer shows while it streams (a MutationObserver sees each render).
    page.evaluate("""() => {
        window.partials = new Set();
        new MutationObserver(() => {
            const node = document.querySelector('.message.assistant.pending .content');
            if (node && node.textContent) window.partials.add(node.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#input", QUESTION)
    page.keyboard.press("Enter")
    expect(page.locator("#stop")).to_be_visible()
    answer = page.locator(".message.assistant .content").last
    expect(page.locator(".message.assistant.pending")).to_have_count(0)
    expect(answer).to_contain_text("Paris")
    partials = page.evaluate("[...window.partials]")
    assert len(partials) >= 2 and all(answer.inner_text().startswith(p.strip()) for p in partials), partials
    stats = _stats(page)
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · TTFT \d+ ms · \d+ cached prompt tokens", stats), stats
    assert sent[0]["dry_multiplier"] == 0.8 and sent[0]["temperature"] == 0 and "min_p" not in sent[0]
    first_answer = answer.inner_text()
    shots(page, "webui-chat", readme=True)

    page.locator(".regenerate").click()
    expect(page.locator(".message.assistant.pending")).to_have_count(0)
    assert len(requests) == 2
    expect(page.locator(".message")).to_have_count(2)        # replaced, not appended
    assert page.locator(".message.assistant .content").last.inner_text() == first_answer    # greedy: the same
    cached = int(re.search(r"(\d+) cached prompt tokens", _stats(page)).group(1))
    assert cached >= 16             # the same prompt again: its full blocks come from the prefix cache

    page.remove_listener("request", count)
    page.reload()                   # the conversation and the settings live in localStorage
    expect(page.locator(".message")).to_have_count(2)
    expect(page.locator("#temperature")).to_have_value("0")
    expect(page.locator("#system")).to_have_value("You are a concise geography tutor.")


def test_stop_ends_the_request(page, server):
    page.goto("/")
    page.fill("#max-tokens", "400")
    page.fill("#input", "Write a very long story about a dragon.")
    page.locator("#send").click()
    answer = page.locator(".message.assistant.pending .content")
    expect(answer).not_to_be_empty()          # the answer has begun
    page.locator("#stop").click()
    expect(page.locator(".message.assistant.pending")).to_have_count(0)
    assert _stats(page).endswith("stopped")
    assert page.locator(".message.assistant .content").last.inner_text().strip()
    wait_for(lambda: _idle(server), what="the server freeing the stopped request's slot")


def _idle(server) -> bool:
    view = httpx.get(server.url + "/slots", headers=AUTH, timeout=30).json()
    return view["queued"] == 0 and all(s["state"] == "idle" for s in view["slots"])


def test_reasoning_folds_and_markdown_renders_escaped(page):
    reply = ("Here is **the** code:\n\n```python\nprint('<b>hi</b>')\n```\n\n- one\n- `two`\n\n"
             "<img src=x onerror=alert(1)> [link](https://example.com)")
    history = {"messages": [{"role": "user", "content": "<i>code</i> please"},
                            {"role": "assistant", "content": reply, "reasoning": "The user wants code."}]}
    page.goto("/")
    page.evaluate("h => localStorage.setItem('cobatch.chat', JSON.stringify(h))", history)
    page.reload()
    reasoning = page.locator(".message.assistant details.reasoning")
    expect(reasoning).to_have_count(1)
    assert reasoning.evaluate("d => d.open") is False
    expect(reasoning.locator(".reasoning-text")).to_be_hidden()
    reasoning.locator("summary").click()
    expect(reasoning.locator(".reasoning-text")).to_have_text("The user wants code.")
    content = page.locator(".message.assistant .content")
    expect(content.locator("pre code.language-python")).to_have_text("print('<b>hi</b>')")
    expect(content.locator("strong")).to_have_text("the")
    expect(content.locator("li")).to_have_count(2)
    expect(content.locator("li code")).to_have_text("two")
    expect(content.locator("a")).to_have_attribute("href", "https://example.com")
    assert content.locator("img, b").count() == 0          # markup in a reply is shown, never run
    expect(content).to_contain_text("<img src=x onerror=alert(1)>")
    expect(page.locator(".message.user")).to_have_text(re.compile("<i>code</i> please"))


def test_dashboard_shows_four_requests_decoding_together(page, server, shots):
    body = {"messages": [{"role": "user", "content": "Count from one to one thousand."}], "temperature": 0,
            "max_tokens": 300, "min_tokens": 300, "stream": True}
    streams = [RawStream(server.url, "/v1/chat/completions", body, AUTH) for _ in range(4)]
    try:
        page.goto("/dashboard")
        page.wait_for_function("""() => {
            const batched = document.getElementById('batched-fraction').dataset.value;
            return document.querySelectorAll('.slot[data-state=decoding]').length === 4 && Number(batched) > 0;
        }""")
        expect(page.locator("#status")).to_have_text("live")
        decoding = page.locator(".slot[data-state=decoding] .slot-detail")
        expect(decoding.first).to_have_text(re.compile(r"\d+ tokens · [\d.]+ tok/s"))
        assert float(page.locator("#rows-per-step").get_attribute("data-value")) > 1
        # the charts have drawn step times and rates (for the README's picture, a few seconds of them)
        page.wait_for_function("""points => ['chart-step', 'chart-toks', 'chart-rows'].every(id => {
            const chart = document.getElementById(id).dataset;
            return chart.last > 0 && chart.points >= points;
        })""", arg=16 if FOR_README else 2)
        assert int(page.locator("#kv-used").inner_text()) >= 4
        shots(page, "webui-dashboard", readme=True)
    finally:
        for stream in streams:
            stream.hard_close()
    wait_for(lambda: _idle(server), what="the four requests aborted")


def test_the_chat_answers_through_a_chosen_lora_adapter(browser, tmp_path):
    """A server with a LoRA adapter lists it beside the model; the page's answers then come from the one chosen."""
    from cobatch.llm import LLM, EngineOptions
    from cobatch.model_files import smollm2_path
    from cobatch.testing.lora_adapters import write_random_adapter
    smol = load_llm("smollm2")
    adapter = write_random_adapter(tmp_path / "adapter", smol.config, rank=4, seed=3)
    llm = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=512, max_num_seqs=2, quiet=True,
                                                 lora_modules=(("tutor", str(adapter), 1.0),)))
    with live_server(llm, ServerOptions(model_name="smol")) as srv:
        page = browser.new_page(base_url=srv.url)
        sent: list[str] = []
        page.on("request", lambda r: sent.append(r.post_data_json["model"])
                if r.url.endswith("/v1/chat/completions") else None)
        page.goto("/")
        choice = page.locator("#model-choice")
        expect(choice).to_be_visible()
        assert choice.locator("option").all_inner_texts() == ["smol", "tutor (adapter)"]
        choice.select_option("tutor")
        expect(page.locator("#model")).to_have_text("tutor")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "4")
        page.fill("#input", "Hi")
        page.keyboard.press("Enter")
        expect(page.locator(".message.assistant")).to_have_count(1)
        expect(page.locator(".message.assistant.pending")).to_have_count(0)
        assert sent == ["tutor"]
        page.close()
