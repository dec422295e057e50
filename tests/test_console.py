"""The web console against real servers: /v1/console/* and the CSP without a browser, then the pages in
headless Chromium (Debian's, driven by Playwright): dashboard charts move after traffic, a playground
stream renders every token with hover details, score mode equals the API, the determinism button
reports one vector, a 429 is shown, and an API key gates everything but the login.

Screenshots go to pytest's temporary directory (STEADYSERVE_ARTIFACTS=dir keeps them elsewhere), never
into the checkout."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from http_util import wait_for
from steadyserve.testing.server import ServerProcess, start_servers

KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = os.environ.get("STEADYSERVE_CHROMIUM", "/usr/bin/chromium")
CHROME_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def servers(tiny_model: str, long_model: str):
    """(keyed, tight): `keyed` needs an API key and has the default capacity; `tight` is open and has one seat
    and no queue, so one long stream makes the next request a 429. Started side by side (startup is mostly imports)."""
    keyed, tight = start_servers(
        ((tiny_model, "--grpc-port", "-1", "--api-key", KEY, "--stall-timeout", "10"), {"threads": 1}),
        ((long_model, "--grpc-port", "-1", "--max-num-seqs", "1", "--max-queue", "0", "--stall-timeout", "10"),
         {"threads": 1}))
    try:
        yield keyed, tight
    finally:
        for s in (keyed, tight):
            s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def keyed(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tight(servers):
    return servers[1]


def stats(srv, headers=AUTH) -> dict:
    r = httpx.get(srv.http_url + "/v1/console/stats", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def complete(srv, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(srv.http_url + "/v1/completions", json=body, headers=headers, timeout=60)


# ---- without a browser ------------------------------------------------------------------------------

def test_stats_shape_and_recent_requests(keyed):
    before = stats(keyed)
    assert before["model"]["fingerprint"] == httpx.get(keyed.http_url + "/readyz").json()["system_fingerprint"]
    for k in ("name", "device", "dtype", "batch_invariant", "selftest", "max_model_len"):
        assert k in before["model"]
    assert before["model"]["batch_invariant"] is True and before["model"]["selftest"]["passed"] is True
    assert before["status"] == {"ready": True, "draining": False, "engine_alive": True, "engine_error": None,
                                "selftest_ok": True}
    assert set(before["gauges"]) >= {"running", "waiting", "kv_cache_usage"}
    assert set(before["counters"]["rejected"]) >= {"overloaded", "invalid", "unauthenticated"}
    assert set(before["counters"]["aborted"]) >= {"client_disconnect", "stall"}
    assert set(before["latency"]) >= {"ttft", "itl", "loop_lag"}

    r = complete(keyed, {"prompt": "stats test", "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    after = stats(keyed)
    assert after["counters"]["generated_tokens"] - before["counters"]["generated_tokens"] == 7
    assert after["counters"]["finished"]["length"] - before["counters"]["finished"]["length"] == 1
    row = after["recent"][0]
    assert row["request_id"] == rid and row["transport"] == "http"
    assert row["generated_tokens"] == 7 and row["finish_reason"] == "length"
    assert 0 < row["ttft_s"] <= row["total_s"]
    assert after["latency"]["ttft"]["count"] >= 1 and after["latency"]["ttft"]["p50"] > 0
    assert after["latency"]["itl"]["p99"] >= after["latency"]["itl"]["p50"] > 0
    # A refusal is counted under its reason.
    bad = complete(keyed, {"prompt": "x", "temperature": 7})
    assert bad.status_code == 400
    assert stats(keyed)["counters"]["rejected"]["invalid"] == after["counters"]["rejected"]["invalid"] + 1


def test_pages_send_strict_csp_and_carry_no_inline_code(keyed):
    for path in ("/", "/playground", "/static/playground.js", "/static/console.css"):
        r = httpx.get(keyed.http_url + path)  # no key: the console's files are open, they carry no data
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        directives = dict((d.strip().split(" ", 1) + [""])[:2] for d in csp.split(";"))
        assert directives["default-src"] == "'self'" and directives["script-src"] == "'self'"
        assert "unsafe" not in csp and directives["frame-ancestors"] == "'none'"
        assert "ws:" in directives["connect-src"]
        assert r.headers["x-content-type-options"] == "nosniff"
    static = Path(__file__).resolve().parent.parent / "src/steadyserve/api/console/static"
    for f in static.iterdir():
        text = f.read_text()
        if f.suffix == ".html":
            assert not re.search(r"\son[a-z]+\s*=", text), f"inline event handler in {f.name}"
            assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"inline script in {f.name}"
            assert " style=" not in text, f"inline style in {f.name}"
        # Nothing leaves the machine: no absolute URLs but the SVG namespace.
        assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", text), f.name
    assert httpx.get(keyed.http_url + "/static/../console.py").status_code == 404
    assert httpx.get(keyed.http_url + "/static/nope.js").status_code == 404
    assert httpx.get(keyed.http_url + "/static/app.js").headers.get("content-type", "").startswith(
        "application/json")  # the 404 body, not a file


def test_api_key_gates_console_data_and_websocket_subprotocol(keyed, tight):
    assert httpx.get(keyed.http_url + "/v1/console/stats").status_code == 401
    r = httpx.post(keyed.http_url + "/v1/console/tokens", json={"ids": [1]})
    assert r.status_code == 401
    assert httpx.get(tight.http_url + "/v1/console/stats").status_code == 200  # no key configured
    # Browsers cannot set headers on a WebSocket: the key rides as a subprotocol, which must be echoed.
    url = f"ws://127.0.0.1:{keyed.http_port}/v1/stream"
    with connect(url, subprotocols=[f"bearer.{KEY}"], open_timeout=30) as ws:
        assert ws.subprotocol == f"bearer.{KEY}"
        ws.send(json.dumps({"prompt": "hi", "max_tokens": 3, "temperature": 0}))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=30)))
        assert msgs[-1]["type"] == "final" and msgs[-1]["usage"]["completion_tokens"] == 3
    # A wrong key is refused at the handshake (closed before accept: HTTP 403), not after a stream started.
    with pytest.raises(InvalidStatus) as e:
        with connect(url, subprotocols=["bearer.wrong"], open_timeout=30) as ws:
            ws.send(json.dumps({"prompt": "hi", "max_tokens": 3}))
            ws.recv(timeout=10)
    assert e.value.response.status_code == 403


def test_tokens_endpoint_matches_echoed_tokens(keyed):
    echo = complete(keyed, {"prompt": "Tokens, with text: ünïcode!", "max_tokens": 0, "echo": True,
                            "logprobs": 0}).json()
    one_more = httpx.post(keyed.http_url + "/v1/completions", headers=AUTH, timeout=30,
                          json={"prompt": "Tokens, with text: ünïcode!", "max_tokens": 1, "temperature": 0,
                                "logprobs": 0, "echo": True}).json()
    tokens = echo["choices"][0]["logprobs"]["tokens"]
    # The echoed prompt is several tokens, and the same ones whether or not a token is generated after it.
    assert len(tokens) >= 5 and "".join(tokens).startswith("Tokens, with text: "), tokens
    assert one_more["choices"][0]["logprobs"]["tokens"][:len(tokens)] == tokens
    assert len(one_more["choices"][0]["logprobs"]["tokens"]) == len(tokens) + 1
    # Re-derive the ids through the stream API (it reports ids), then ask the console endpoint for their text.
    with connect(f"ws://127.0.0.1:{keyed.http_port}/v1/stream", subprotocols=[f"bearer.{KEY}"]) as ws:
        ws.send(json.dumps({"prompt": "Tokens", "max_tokens": 6, "temperature": 0, "logprobs": 2}))
        deltas = []
        while True:
            m = json.loads(ws.recv(timeout=30))
            if m["type"] != "delta":
                break
            deltas.append(m)
    gen_ids = [t for m in deltas for t in m["token_ids"]]
    r = httpx.post(keyed.http_url + "/v1/console/tokens", headers=AUTH, json={"ids": gen_ids})
    assert r.status_code == 200
    http = complete(keyed, {"prompt": "Tokens", "max_tokens": 6, "temperature": 0, "logprobs": 0}).json()
    assert r.json()["tokens"] == http["choices"][0]["logprobs"]["tokens"]
    for bad in ({"ids": [-1]}, {"ids": [10**9]}, {"ids": "1"}, {"nope": 1}, {"ids": [True]}):
        r = httpx.post(keyed.http_url + "/v1/console/tokens", headers=AUTH, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "ids", bad


# ---- in a real browser -------------------------------------------------------------------------------

def _browser_unavailable() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[test]')"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return (f"no Chromium at {CHROMIUM}: `make test` installs Debian's `chromium` when run as root with "
                "apt-get; elsewhere install it (or set STEADYSERVE_CHROMIUM)")
    return None


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: a temporary directory, or STEADYSERVE_ARTIFACTS when set."""
    where = os.environ.get("STEADYSERVE_ARTIFACTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        return Path(where)
    return tmp_path_factory.mktemp("console-artifacts")


@pytest.fixture(scope="module")
def browser():
    why = _browser_unavailable()
    if why:
        pytest.skip(f"browser tests skipped: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        yield b
        b.close()


class Page:
    """A tab with its console errors collected (a CSP violation is one)."""

    def __init__(self, browser, key: str | None, width: int = 1280, height: int = 800) -> None:
        self.ctx = browser.new_context(viewport={"width": width, "height": height})
        if key:  # what the login form stores; the login itself is tested once, below
            self.ctx.add_init_script(f"sessionStorage.setItem('steadyserve.apiKey', {json.dumps(key)})")
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(30_000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def close(self) -> None:
        self.ctx.close()


@pytest.fixture
def tab(browser):
    tabs: list[Page] = []

    def make(key: str | None = KEY, **kw) -> Page:
        t = Page(browser, key, **kw)
        tabs.append(t)
        return t

    yield make
    for t in tabs:
        t.close()


def no_horizontal_scroll(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def test_login_gates_everything(tab, keyed):
    t = tab(key=None)
    pg = t.page
    pg.goto(keyed.http_url + "/")
    pg.wait_for_selector("#api-key", state="visible")
    assert pg.locator(".app:visible").count() == 0  # nothing but the login
    assert "fingerprint" not in pg.inner_text("body").lower()
    pg.fill("#api-key", "wrong-key")
    pg.keyboard.press("Enter")
    pg.wait_for_function("() => document.querySelector('#login-error').textContent.includes('not accepted')")
    assert pg.locator(".app:visible").count() == 0
    pg.fill("#api-key", KEY)
    pg.keyboard.press("Enter")
    pg.wait_for_selector("#m-fp:has-text('-bi')")
    assert pg.evaluate("sessionStorage.getItem('steadyserve.apiKey')") == KEY
    assert pg.is_visible("#signout")
    assert not [e for e in t.errors if "401" not in e], t.errors  # the failed attempt logs its 401, nothing else


def test_dashboard_charts_update_after_traffic(tab, keyed, artifacts):
    t = tab()
    pg = t.page
    pg.goto(keyed.http_url + "/")
    fp = stats(keyed)["model"]["fingerprint"]
    pg.wait_for_selector(f"#m-fp:has-text('{fp}')")
    assert pg.inner_text("#m-device") == "cpu" and pg.inner_text("#m-dtype") == "float32"
    assert "self-test passed" in pg.inner_text("#m-bi")
    assert pg.is_hidden("#banner")
    pg.wait_for_function("() => Number(document.querySelector('figure[data-chart=requests]').dataset.points) >= 2")

    done: list[str] = []

    def traffic() -> None:
        with ThreadPoolExecutor(4) as pool:
            for r in pool.map(lambda i: complete(keyed, {"prompt": f"dashboard {i}", "max_tokens": 40,
                                                          "ignore_eos": True}), range(12)):
                done.append(r.headers["x-request-id"])
        # a refusal and an abort, so the refusal chart has something to show
        complete(keyed, {"prompt": "x", "top_p": 0})

    th = threading.Thread(target=traffic)
    th.start()
    th.join(90)
    assert len(done) == 12
    pg.wait_for_function("() => Number(document.querySelector('figure[data-chart=tokens]').dataset.max) > 0")
    pg.wait_for_function("() => Number(document.querySelector('figure[data-chart=ttft]').dataset.max) > 0")
    pg.wait_for_function("() => Number(document.querySelector('figure[data-chart=itl]').dataset.max) > 0")
    pg.wait_for_function("() => Number(document.querySelector('figure[data-chart=refusals]').dataset.max) > 0")
    pg.wait_for_selector(f"#recent tr[data-request-id='{done[-1]}']")
    row = pg.inner_text(f"#recent tr[data-request-id='{done[-1]}']")
    assert "http" in row and "40" in row and "length" in row
    assert "rejected: invalid" in pg.inner_text("figure[data-chart=refusals] .legend")
    label = pg.get_attribute("figure[data-chart=tokens] canvas", "aria-label")
    assert label.startswith("Output tokens/s") and "Latest" in label
    time.sleep(1.2)  # one more poll so the lines have drawn past the burst
    pg.screenshot(path=str(artifacts / "console-dashboard.png"))
    assert no_horizontal_scroll(pg)
    pg.set_viewport_size({"width": 420, "height": 900})
    pg.wait_for_timeout(500)
    assert no_horizontal_scroll(pg)
    pg.screenshot(path=str(artifacts / "console-dashboard-narrow.png"))
    assert not t.errors, t.errors


def ws_run(srv, req: dict) -> list[dict]:
    with connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream", subprotocols=[f"bearer.{KEY}"]) as ws:
        ws.send(json.dumps(req))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=60)))
    return msgs


def test_playground_stream_renders_every_token_with_details(tab, keyed, artifacts):
    t = tab()
    pg = t.page
    pg.goto(keyed.http_url + "/playground")
    pg.fill("#prompt", "Once upon a time")
    pg.fill("#temperature", "0.8")
    pg.fill("#seed", "7")
    pg.fill("#max_tokens", "24")
    pg.click("#stream")
    pg.wait_for_selector("#tokens[data-done]")
    assert pg.get_attribute("#tokens", "data-done") == "24"
    assert pg.locator("#tokens .tok").count() == 24
    assert pg.is_hidden("#error")
    assert "length" in pg.inner_text("#status")
    # The same request over the WebSocket from here: the page shows exactly its ids and logprobs.
    msgs = ws_run(keyed, {"prompt": "Once upon a time", "temperature": 0.8, "seed": 7, "max_tokens": 24,
                          "logprobs": 5})
    lps = [lp for m in msgs if m["type"] == "delta" for lp in m["logprobs"]]
    ids = pg.eval_on_selector_all("#tokens .tok", "els => els.map(e => Number(e.dataset.tokenId))")
    shown = pg.eval_on_selector_all("#tokens .tok", "els => els.map(e => Number(e.dataset.logprob))")
    assert ids == [lp["token_id"] for lp in lps]
    assert shown == [lp["logprob"] for lp in lps]
    # Shading follows the probability.
    classes = pg.eval_on_selector_all("#tokens .tok", "els => els.map(e => e.className)")
    for c, lp in zip(classes, lps):
        p = math.exp(lp["logprob"])
        want = next((f"p{5 - i}" for i, b in enumerate([0.9, 0.6, 0.3, 0.1, 0.01]) if p >= b), "p0")
        assert want in c.split(), (c, p)
    # Hover: logprob and the top alternatives.
    pg.hover("#tokens .tok >> nth=2")
    pg.wait_for_selector("#tip", state="visible")
    tip = pg.inner_text("#tip")
    assert f"logprob {lps[2]['logprob']:.4f}" in tip
    assert pg.locator("#tip tbody tr").count() == 5
    # Keyboard: focus the first token, arrow right shows the second.
    pg.mouse.move(0, 0)
    pg.focus("#tokens .tok >> nth=0")
    pg.keyboard.press("ArrowRight")
    assert pg.evaluate("document.activeElement.dataset.i") == "1"
    assert f"logprob {lps[1]['logprob']:.4f}" in pg.inner_text("#tip")
    pg.hover("#tokens .tok >> nth=5")
    pg.screenshot(path=str(artifacts / "console-playground.png"))
    assert no_horizontal_scroll(pg)
    pg.set_viewport_size({"width": 420, "height": 900})
    pg.wait_for_timeout(300)
    assert no_horizontal_scroll(pg)
    pg.screenshot(path=str(artifacts / "console-playground-narrow.png"), full_page=True)
    # A validation error is shown as the server's message.
    pg.set_viewport_size({"width": 1280, "height": 800})
    pg.fill("#temperature", "5")
    pg.click("#stream")
    pg.wait_for_selector("#error", state="visible")
    assert "temperature" in pg.inner_text("#error") and "rejected" in pg.inner_text("#error").lower()
    assert not t.errors, t.errors


def test_score_mode_equals_the_api(tab, keyed):
    text = "Pasted text, scored token by token: zebra quantum pancake."
    api = complete(keyed, {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 5}).json()
    want = api["choices"][0]["logprobs"]
    t = tab()
    pg = t.page
    pg.goto(keyed.http_url + "/playground")
    pg.check("input[name=mode][value=score]")
    assert pg.is_visible("#score") and pg.is_hidden("#stream")
    pg.fill("#prompt", text)
    pg.click("#score")
    pg.wait_for_selector("#tokens[data-done]")
    texts = pg.eval_on_selector_all("#tokens .tok", "els => els.map(e => e._info.text)")
    shown = pg.eval_on_selector_all("#tokens .tok", "els => els.map(e => e.dataset.logprob)")
    assert texts == want["tokens"]
    assert [None if s == "" else float(s) for s in shown] == want["token_logprobs"]
    pg.hover("#tokens .tok >> nth=4")
    assert f"logprob {want['token_logprobs'][4]:.4f}" in pg.inner_text("#tip")
    assert "perplexity" in pg.inner_text("#summary")
    assert not t.errors, t.errors


def test_check_determinism_reports_one_vector(tab, keyed):
    t = tab()
    pg = t.page
    pg.goto(keyed.http_url + "/playground")
    pg.fill("#prompt", "Determinism, please:")
    pg.fill("#temperature", "0")
    pg.fill("#max_tokens", "16")
    pg.fill("#det-n", "12")
    pg.fill("#det-bg", "6")
    pg.click("#check-det")
    pg.wait_for_selector("#det-result[data-distinct]", timeout=90_000)
    assert pg.get_attribute("#det-result", "data-distinct") == "1", pg.inner_text("#det-result")
    assert pg.get_attribute("#det-result", "data-drift") == "0"
    assert "1 of 12" in pg.inner_text("#det-result")
    pg.fill("#det-n", "65")
    pg.click("#check-det")
    pg.wait_for_selector("#error", state="visible")
    assert "between 1 and 64" in pg.inner_text("#error")
    assert not t.errors, t.errors


def test_overload_is_shown_as_a_message(tab, tight):
    """One seat, no queue: while a long stream holds the seat, the playground's stream and score get a 429."""
    with connect(f"ws://127.0.0.1:{tight.http_port}/v1/stream", close_timeout=1) as hold:
        # 4000 tokens hold the one seat for the whole test, however fast the engine runs.
        hold.send(json.dumps({"prompt": "hold", "max_tokens": 4000, "ignore_eos": True}))
        wait_for(lambda: stats(tight, headers={})["gauges"]["in_flight"] == 1, 30, what="the seat taken")
        t = tab(key=None)
        pg = t.page
        pg.goto(tight.http_url + "/playground")
        pg.wait_for_selector("#prompt", state="visible")
        pg.click("#stream")
        pg.wait_for_selector("#error", state="visible")
        msg = pg.inner_text("#error")
        assert "overloaded (429)" in msg and "Retry after" in msg, msg
        pg.check("input[name=mode][value=score]")
        pg.click("#score")
        pg.wait_for_function("() => document.querySelector('#error').textContent.includes('429')")
        assert "Retry after" in pg.inner_text("#error")
        assert [e for e in t.errors if "429" not in e] == [], t.errors  # the browser logs the HTTP 429 itself
