"""The dashboard in a real browser: headless Chromium driven over the DevTools protocol (tests/support/browser.py)
against ``sluice serve`` with a batch in progress: login, a wrong key, the rendered progress, counts and
error rows, a key that never reaches a URL, and the screenshot in docs/.

The worker runs in this process on a paced engine (tests/support/paced.py: at most PACE steps a second), so the batch is in
progress with jobs still queued whenever the page is read, however fast the machine: its 3,000 jobs of
48 tokens, 8 at a time, need at least 18,000 steps, six minutes at that pace, far longer than the reads.

``SLUICE_DASHBOARD_SCREENSHOT=docs/dashboard.png pytest tests/api/test_dashboard_browser.py`` rewrites the
screenshot in docs/monitoring.md."""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import CHROMIUM, Browser
from cli_api_helpers import run_sluice, simple_lines, sluice_home, start_sluice, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, wait_for
from paced import PacedLLM
from sluice.api.rate_samples import MIN_GAP
from sluice.cli.common import EXIT_SOME_FAILED

KEY = "sk-dash-" + secrets.token_hex(8)


@dataclass
class Up:
    url: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    if CHROMIUM is None:
        pytest.skip("no chromium to test the dashboard in a browser (Debian: apt-get install chromium)")
    home = tmp_path_factory.mktemp("dash-up") / "home"
    with sluice_home(home):
        env = {**os.environ, "SLUICE_API_KEY": KEY}
        log = home.parent / "serve.log"
        proc = start_sluice("serve", "--port", "0", log=log, env=env)
        llm = PacedLLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=8)
        worker = ThreadWorker(llm, queue="tiny", grace_period=5)
        try:
            yield Up(wait_for_url(proc, log), env)
        finally:
            worker.join()
            stop(proc)


def _status(up: Up, batch_id: str) -> dict[str, Any]:
    res = run_sluice("status", batch_id, "--json", env=up.env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_browser_watches_a_batch_in_progress(up: Up, tmp_path: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    n_bad, n_refused = rng.randint(1, 3), rng.randint(1, 3)
    # The worker refuses these; their prompt sorts before every word, so the batch's plan (jobs grouped by
    # prompt, jobs/prefix_plan.py) hands them out first, as their place in the file did.
    lines = [json.dumps({"custom_id": f"refused-{i}", "prompt": "0", "max_tokens": 4,
                         "stop_token_ids": [10**9]}) for i in range(n_refused)]
    lines += simple_lines(rng, 3000, max_tokens=48, ignore_eos=True)  # minutes of work for the tiny model
    for _ in range(n_bad):
        lines.insert(rng.randrange(n_refused, len(lines) + 1), "{not json")
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = run_sluice("submit", str(src), "--json", env=up.env)
    assert res.returncode == EXIT_SOME_FAILED and f"{n_bad} bad lines" in res.stderr, res.stderr  # queued all the same
    bid = json.loads(res.stdout)["id"]
    total = 3000 + n_refused
    wait_for(lambda: _status(up, bid)["request_counts"]["failed"] >= n_refused, 120, "the refused lines to fail")

    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
        browser.open(f"{up.url}/")
        # Without the key: the login and nothing else.
        browser.until("!document.getElementById('login').hidden", "the login")
        assert browser.js("document.getElementById('app').hidden") is True
        assert bid not in browser.js("document.body.innerText")
        # A wrong key: an error, still only the login.
        browser.type_key("sk-wrong")
        error = browser.until("document.getElementById('login-error').textContent", "the wrong key's error")
        assert "refused" in error and browser.js("document.getElementById('app').hidden") is True
        assert browser.js("sessionStorage.length") == 0
        # The key: the batches and the workers.
        browser.type_key(KEY)
        browser.until(f"!!document.querySelector('#batches tr[data-batch=\"{bid}\"]')", "the batch in the list")
        assert browser.js("sessionStorage.getItem('sluice-api-key')") == KEY
        assert browser.js("document.querySelectorAll('#workers tr[data-worker]').length") == 1
        queue = browser.js("document.querySelector('#workers tr[data-worker] td').textContent.trim()")
        assert queue == _status(up, bid)["model"] == "tiny"
        queued = browser.js("document.querySelector('#workers tr[data-queue=tiny] [data-queued]').textContent")
        assert 0 < int(queued.replace(",", "")) < total

        # A refresh keeps keyboard focus where it was.
        browser.js(f"document.querySelector('#batches a[href=\"/batches/{bid}\"]').focus()")
        stamp = browser.js("document.getElementById('updated').textContent")
        browser.until(f"document.getElementById('updated').textContent !== {json.dumps(stamp)}", "a refresh")
        assert browser.js("document.activeElement.getAttribute('href')") == f"/batches/{bid}"

        before = _status(up, bid)["request_counts"]
        browser.js(f"document.querySelector('#batches a[href=\"/batches/{bid}\"]').click()")
        browser.until("!!document.getElementById('progress')", "the batch page (its key from sessionStorage)")
        # The chart needs two samples, MIN_GAP apart: a few refreshes of the page (more for the docs' screenshot).
        steps = 16 if os.environ.get("SLUICE_DASHBOARD_SCREENSHOT") else 2
        browser.until(f"(document.querySelector('#batch polyline') || {{}}).getAttribute?.('points')?.split(' ')"
                      f".length >= {2 * steps}", "the throughput chart", timeout=30 + 3 * MIN_GAP * steps)
        dom = browser.js("""(() => {
            const p = document.getElementById('progress');
            const count = (k) => Number(document.querySelector(`[data-count=${k}]`).textContent.replace(/,/g, ''));
            return {value: Number(p.getAttribute('value')), max: Number(p.getAttribute('max')),
                    status: document.getElementById('batch-status').textContent,
                    completed: count('completed'), failed: count('failed'), invalid: count('invalid'),
                    codes: Array.from(document.querySelectorAll('tr.error-row')).map(r => r.dataset.code),
                    samples: document.querySelector('tr.error-row[data-code=invalid_request] .samples').textContent,
                    rate: document.querySelector('[data-rate=tokens]').textContent,
                    href: location.href};
        })()""")
        after = _status(up, bid)["request_counts"]
        assert dom["max"] == total and dom["status"] == "in_progress", (dom, seed)
        assert before["completed"] <= dom["completed"] <= after["completed"] < total, (dom, seed)
        assert dom["value"] == dom["completed"] + dom["failed"] and dom["failed"] == n_refused, (dom, seed)
        assert dom["invalid"] == n_bad and set(dom["codes"]) == {"invalid_json", "invalid_request"}, (dom, seed)
        assert "refused-" in dom["samples"] and float(dom["rate"]) > 0, (dom, seed)
        assert dom["href"] == f"{up.url}/batches/{bid}"

        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
        assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 20_000
        (tmp_path / "dashboard.png").write_bytes(shot)
        if target := os.environ.get("SLUICE_DASHBOARD_SCREENSHOT"):
            Path(target).write_bytes(shot)

        # The key went in headers only: no URL the browser asked for holds it.
        urls = browser.urls()
        assert any("/dashboard/batches/" in u for u in urls) and not [u for u in urls if KEY in u]
        link = browser.js("document.querySelector('a[href*=\"/output.jsonl\"]').href")
        assert KEY not in link
        got = httpx.get(link, timeout=60)  # a signed link, no key
        assert got.status_code == 200 and all(json.loads(x)["response"]["status_code"] == 200
                                              for x in got.text.splitlines()), seed

        browser.js("document.getElementById('logout').click()")
        browser.until("!document.getElementById('login').hidden", "the login after logging out")
        assert browser.js("sessionStorage.length") == 0 and bid not in browser.js("document.body.innerText")
    finally:
        browser.close()
        run_sluice("cancel", bid, env=up.env)


def _refreshed(browser: Browser) -> None:
    """The app shown and one whole refresh seen after its first: every fragment fetched at least twice."""
    stamp = browser.until("!document.getElementById('app').hidden && "
                          "document.getElementById('updated').textContent", "the app's first refresh")
    browser.until(f"document.getElementById('updated').textContent !== {json.dumps(stamp)}", "a refresh")


def _clean(browser: Browser, url: str, shows: str, since: int | None = None) -> None:
    """Open ``url`` (unless ``since`` says it is open already) until it shows the login or the app; no
    console error, failed request or response >= 400 meanwhile."""
    mark = len(browser.events) if since is None else since
    if since is None:
        browser.open(url)
    if shows == "login":
        browser.until("!document.getElementById('login').hidden", f"the login on {url}")
        assert browser.js("document.getElementById('app').hidden") is True
    else:
        _refreshed(browser)
    assert browser.problems(mark) == [], (url, shows)


def test_no_page_logs_a_console_error_logged_in_or_out(up: Up, tmp_path: Path) -> None:
    """Issue 42, item 6: every dashboard page logged out, with a wrong key, logged in and logged out again
    (SLUICE_API_KEY set), and on a server without a key: no console error, no failed request, no response
    >= 400 (the page asks /dashboard/session whether to show its login); the icon loads as an image."""
    rng = random.Random(fresh_seed())
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(simple_lines(rng, 3, max_tokens=2, prefix="console")) + "\n")
    res = run_sluice("submit", str(src), "--json", env=up.env)
    assert res.returncode == 0, res.stderr
    bid = json.loads(res.stdout)["id"]
    pages = ["/", f"/?after={bid}", f"/batches/{bid}"]
    log = tmp_path / "open-serve.log"
    open_proc = start_sluice("serve", "--port", "0", log=log,  # the same job server, no key
                             env={k: v for k, v in up.env.items() if k != "SLUICE_API_KEY"})
    browser = Browser(tmp_path / "profile")
    try:
        for page in pages:
            _clean(browser, up.url + page, "login")
        mark = len(browser.events)
        browser.type_key("sk-wrong")
        error = browser.until("document.getElementById('login-error').textContent", "the wrong key's error")
        assert "refused" in error
        _clean(browser, up.url, "login", since=mark)
        mark = len(browser.events)
        browser.type_key(KEY)
        _clean(browser, up.url, "app", since=mark)
        for page in pages:
            _clean(browser, up.url + page, "app")
        icon = browser.js("""Promise.all([document.querySelector('link[rel=icon]').href, '/favicon.ico'].map(
            (src) => new Promise((done) => {
                const img = new Image();
                img.onload = () => done(img.naturalWidth);
                img.onerror = () => done(-1);
                img.src = src;
            })))""")
        assert icon == [32, 32]
        mark = len(browser.events)
        browser.js("document.getElementById('logout').click()")
        _clean(browser, up.url, "login", since=mark)
        _clean(browser, up.url + f"/batches/{bid}", "login")
        assert browser.problems() == []  # and nothing before the marks either

        open_url = wait_for_url(open_proc, log)
        for page in pages:
            _clean(browser, open_url + page, "app")
            assert browser.js("document.getElementById('logout').hidden") is True
    finally:
        browser.close()
        stop(open_proc)
        run_sluice("cancel", bid, env=up.env)
