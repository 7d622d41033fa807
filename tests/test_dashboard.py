"""The dashboard (api/dashboard.py): pages without data, fragments behind the API key, signed download
links, the rate-sample ring, 10,000 batches paged; and in a real browser, headless Chromium driven over
the DevTools protocol against ``sluice up`` with a batch in progress: login, a wrong key, the rendered
progress, counts and error rows, a key that never reaches a URL, and the screenshot in docs/.

``SLUICE_DASHBOARD_SCREENSHOT=docs/dashboard.png pytest tests/test_dashboard.py -k browser`` rewrites
the README's screenshot."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import secrets
import select
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cli_api_helpers import run_sluice, simple_lines, sluice_home, start_sluice, stop, wait_for_url
from fastapi.testclient import TestClient
from helpers import fresh_seed
from jobs_helpers import wait_for

from api.app import create_app
from api.dashboard import HEADERS, PAGE_SIZE, download_url
from api.rate_samples import MIN_GAP, SIZE, RateSamples
from api.settings import Settings
from cli.common import EXIT_SOME_FAILED
from jobs.connection import stop_server
from jobs.schemas import Batch, BatchCounts, BatchStatus, ResultUsage
from jobs.store import cancel_batch, count_batches, get_batch
from jobs.submit import submit

KEY = "sk-dash-" + secrets.token_hex(8)
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Api:
    client: TestClient
    app: Any

    def get(self, path: str, key: str | None = KEY, **kw: Any) -> Any:  # the TestClient's response
        return self.client.get(path, headers={"Authorization": f"Bearer {key}"} if key else {}, **kw)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    home = tmp_path_factory.mktemp("dash") / "home"
    with sluice_home(home):
        app = create_app(Settings(api_key=KEY, files_dir=home.parent / "files"))
        with TestClient(app) as client:
            yield Api(client, app)


def _lines(rng: random.Random, n: int, bad: int) -> str:
    good = simple_lines(rng, n, max_tokens=3)
    for _ in range(bad):
        good.insert(rng.randrange(len(good) + 1), "{not json")
    return "\n".join(good) + "\n"


# ---- pages and fragments --------------------------------------------------------------------------
def test_pages_hold_no_data_and_fragments_need_the_key(api: Api) -> None:
    rng = random.Random(fresh_seed())
    r = api.app.state.sluice.redis()
    n, bad = rng.randint(3, 9), rng.randint(1, 3)
    batch = submit(io.StringIO(_lines(rng, n, bad)), r=r, model="tiny")

    for path in ("/", f"/batches/{batch.id}"):
        page = api.get(path, key=None)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
        assert 'id="login"' in page.text and 'type="password"' in page.text and "<script>" not in page.text
        assert "in_progress" not in page.text and "data-count" not in page.text  # no status, no counts
    assert batch.id not in api.get("/", key=None).text

    for path in ("/dashboard/batches", f"/dashboard/batches/{batch.id}", "/dashboard/workers"):
        for key in (None, "sk-wrong"):
            refused = api.get(path, key=key)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        ok = api.get(path)
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/html"), ok.text
        assert re.fullmatch(r"app;dur=\d+\.\d", ok.headers["server-timing"])

    listed = api.get("/dashboard/batches").text
    assert f'data-batch="{batch.id}"' in listed and f"0 / {n}" in listed and f"+ {bad} bad lines" in listed
    one = api.get(f"/dashboard/batches/{batch.id}").text
    assert f'<progress id="progress" class="big" max="{n}" value="0">' in one
    assert f'data-count="invalid">{bad}<' in one and 'data-count="completed">0<' in one
    assert one.count('class="error-row" data-code="invalid_json"') == 1 and "line " in one
    assert "No live workers" in api.get("/dashboard/workers").text

    missing = api.get("/dashboard/batches/batch_nope")
    assert missing.status_code == 404 and "No batch &#39;batch_nope&#39;" in missing.text  # escaped
    assert api.get("/dashboard/batches", params={"after": "batch_nope"}).status_code == 404


def test_the_page_needs_nothing_from_elsewhere(api: Api) -> None:
    """Offline: no URL outside the API in the templates or the static files, and no inline script (the
    Content-Security-Policy forbids it)."""
    files = [*(ROOT / "api" / "templates").glob("*.html"), *(ROOT / "api" / "static").iterdir()]
    assert len(files) >= 6
    for f in files:
        text = f.read_text()
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f
        assert not re.search(r"<script>|\son\w+=", text), f
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        got = api.get(f"/dashboard/static/{name}", key=None)
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind)
    assert api.get("/dashboard/static/..%2Fdashboard.py", key=None).status_code == 404


def test_download_links_are_signed_not_keyed(api: Api) -> None:
    rng = random.Random(fresh_seed())
    r = api.app.state.sluice.redis()
    n, bad = rng.randint(3, 9), rng.randint(1, 3)
    batch = submit(io.StringIO(_lines(rng, n, bad)), r=r, model="tiny")
    cancel_batch(r, batch.id)  # every job gets its outcome (cancelled) without a worker

    html = api.get(f"/dashboard/batches/{batch.id}").text
    links = {k: v.replace("&amp;", "&") for v, k in re.findall(r'href="([^"]+/(output|errors)\.jsonl[^"]*)"', html)}
    assert set(links) == {"output", "errors"} and not any(KEY in u for u in links.values())
    errors = api.get(links["errors"], key=None)
    assert errors.status_code == 200 and errors.headers["content-disposition"].endswith(f'{batch.id}_errors.jsonl"')
    lines = [json.loads(x) for x in errors.text.splitlines()]
    assert len(lines) == n + bad
    assert sorted(x["error"]["code"] for x in lines) == sorted(["batch_cancelled"] * n + ["invalid_json"] * bad)
    assert api.get(links["output"], key=None).text == ""  # nothing completed

    tampered = links["errors"][:-1] + ("0" if links["errors"][-1] != "0" else "1")
    old = download_url(batch.id, "errors", KEY, time.time() - 3600)  # its link lapsed 50 minutes ago
    other = links["errors"].replace("/errors.jsonl", "/output.jsonl")  # a signature is for one file
    for url in (tampered, old, other, f"/dashboard/batches/{batch.id}/errors.jsonl", links["errors"] + "\u00e9"):
        refused = api.get(url, key=None)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_link", url


# ---- the rate samples -----------------------------------------------------------------------------
def _batch(done: int, tokens: int, start: float, status: BatchStatus = "in_progress", ended: float | None = None) -> Batch:
    return Batch(id="batch_x", model="m", status=status, counts=BatchCounts(total=10**9, completed=done),
                 usage=ResultUsage(completion_tokens=tokens), created_at=start, in_progress_at=start,
                 completed_at=ended)


def test_rate_samples_are_the_counters_differences() -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    ring, start = RateSamples(), 1000.0
    t, done, tokens = start, 0, 0
    seen: list[tuple[float, int, int]] = [(start, 0, 0)]
    for _ in range(rng.randint(SIZE // 2, SIZE - 2)):  # below the ring's size: nothing halved yet
        t += MIN_GAP + rng.random() * 5
        done += rng.randint(0, 50)
        tokens += rng.randint(0, 5000)
        points = ring.observe(_batch(done, tokens, start), t)
        seen.append((t, done, tokens))
        ring.observe(_batch(done + 1, tokens + 1, start), t + MIN_GAP / 2)  # too soon after: not sampled
    assert len(points) == len(seen) - 1, seed
    for p, (t0, d0, k0), (t1, d1, k1) in zip(points, seen[:-1], seen[1:], strict=True):
        assert (p.t0, p.t) == (t0, t1), seed
        assert p.jobs_per_s == pytest.approx((d1 - d0) / (t1 - t0)), seed
        assert p.tokens_per_s == pytest.approx((k1 - k0) / (t1 - t0)), seed


def test_rate_samples_stay_bounded_and_end_with_the_batch() -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    ring, start, t, done = RateSamples(), 50.0, 50.0, 0
    for _ in range(rng.randint(3 * SIZE, 5 * SIZE)):
        t += MIN_GAP + rng.random()
        done += rng.randint(1, 9)
        points = ring.observe(_batch(done, 7 * done, start), t)
        assert len(points) < SIZE, seed
        assert points[0].t0 == start and points[-1].t == t, seed  # the whole span, however long
    total = sum(p.jobs_per_s * (p.t - p.t0) for p in points)
    assert total == pytest.approx(done), seed  # halving drops samples, never jobs
    ended = t + 1.5
    for later in (ended + 10, ended + 1000):  # read long after it finished: the last rate stays
        final = ring.observe(_batch(done + 5, 7 * (done + 5), start, "completed", ended), later)
        assert final[-1].t == ended and final[-1].jobs_per_s == pytest.approx(5 / 1.5), seed


# ---- 10,000 batches ---------------------------------------------------------------------------------
def _calls(r: Any) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def test_ten_thousand_batches_page_by_page(api: Api, capsys: pytest.CaptureFixture[str]) -> None:
    """A page of the list costs the same Redis work with 10,000 batches as with a few (a page, not a
    scan); its server time (the fragment's Server-Timing) is printed, never asserted: speed depends on
    the machine and what else runs on it."""
    r = api.app.state.sluice.redis()
    have = count_batches(r)
    for i in range(have, 10_000):
        submit(io.StringIO(json.dumps({"custom_id": f"c{i}", "prompt": "p", "max_tokens": 1}) + "\n"), r=r,
               model="many")
    seen: list[str] = []
    after: str | None = None
    for _ in range(4):
        before = _calls(r)
        got = api.get("/dashboard/batches", params={"after": after} if after else {})
        calls = _calls(r) - before
        assert got.status_code == 200
        ids = re.findall(r'<tr data-batch="([^"]+)">', got.text)
        assert len(ids) == PAGE_SIZE and not set(ids) & set(seen)
        assert "10,000 batches, newest first" in got.text and 'rel="next"' in got.text
        # ZREVRANGEBYSCORE, a HGETALL per row (and one more, to know there is a next page), ZCARD, and
        # with ``after`` its HGETALL and LRANGE: nothing grows with the number of batches.
        assert calls <= PAGE_SIZE + 6, calls
        seen += ids
        after = ids[-1]
    created = [get_batch(r, b, max_errors=0).created_at for b in seen]  # type: ignore[union-attr]
    assert created == sorted(created, reverse=True)
    ms = []
    for _ in range(20):
        ms.append(float(api.get("/dashboard/batches").headers["server-timing"].removeprefix("app;dur=")))
        ms.append(float(api.get("/dashboard/batches", params={"after": seen[-1]}).headers["server-timing"]
                        .removeprefix("app;dur=")))
    t0 = time.perf_counter()
    page = api.get("/", key=None)
    shell_ms = 1000 * (time.perf_counter() - t0)
    assert page.status_code == 200
    with capsys.disabled():
        print(f"\n10,000 batches: a page of {PAGE_SIZE} takes {statistics.median(ms):.1f} ms server time "
              f"(median of {len(ms)}, max {max(ms):.1f}); the page shell {shell_ms:.1f} ms in-process")


# ---- in a real browser ------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe"]


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages
    ending in NUL, to it on fd 3 and from it on fd 4), so no websocket client or driver is needed."""

    def __init__(self, profile: Path) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()

        def fds() -> None:  # in the child: its ends as fds 3 and 4, kept across exec
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.w, self.r = to_w, from_r
        self.buf = b""
        self.n = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self.call(f"{domain}.enable")

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self.n += 1
        msg: dict[str, Any] = {"id": self.n, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self.buf:
                ready, _, _ = select.select([self.r], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(self.r, 1 << 20) if ready else b""
                if not chunk:
                    raise AssertionError(f"chromium did not answer {method}")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            got = json.loads(raw)
            if got.get("id") == self.n:
                if "error" in got:
                    raise AssertionError(f"{method}: {got['error']}")
                return got["result"]
            self.events.append(got)

    def js(self, expression: str) -> Any:
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise AssertionError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def until(self, expression: str, what: str, timeout: float = 60) -> Any:
        return wait_for(lambda: self.js(expression), timeout, what, every=0.2)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.until("document.readyState === 'complete' && !!document.body.dataset.view", f"{url} to load")

    def type_key(self, key: str) -> None:
        self.js("document.getElementById('key').focus()")
        self.call("Input.insertText", text=key)
        self.js("document.querySelector('#login-form button[type=submit]').click()")

    def urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.w)
        os.close(self.r)


@dataclass
class Up:
    url: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    if CHROMIUM is None:
        pytest.skip("no chromium to test the dashboard in a browser (Debian: apt-get install chromium)")
    home = tmp_path_factory.mktemp("dash-up") / "home"
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env.update(SLUICE_HOME=str(home), SLUICE_API_KEY=KEY)
    log = home.parent / "up.log"
    proc = start_sluice("up", "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                        "--max-num-seqs", "8", "--queue", "tiny", "--port", "0", "--grace-period", "5", log=log,
                        env=env)
    try:
        yield Up(wait_for_url(proc, log, timeout=600), env)  # the first start may build the C++ op
    finally:
        stop(proc)
        stop_server(home, kill=True)  # in case a failed test left it


def _status(up: Up, batch_id: str) -> dict[str, Any]:
    res = run_sluice("status", batch_id, "--json", env=up.env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_browser_watches_a_batch_in_progress(up: Up, tmp_path: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    n_bad, n_refused = rng.randint(1, 3), rng.randint(1, 3)
    lines = [json.dumps({"custom_id": f"refused-{i}", "prompt": "x", "max_tokens": 4,
                         "stop_token_ids": [10**9]}) for i in range(n_refused)]  # the worker refuses these
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
        # The chart needs two samples, MIN_GAP apart: a few refreshes of the page (more for the README's).
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


def test_without_a_server_key_no_login_and_plain_links(tmp_path: Path) -> None:
    """A server without SLUICE_API_KEY: the fragments answer without a key (the page skips the login)
    and download links need no signature."""
    rng = random.Random(fresh_seed())
    with sluice_home(tmp_path / "home"):
        app = create_app(Settings(api_key=None, files_dir=tmp_path / "files"))
        with TestClient(app) as client:
            r = app.state.sluice.redis()
            n = rng.randint(2, 6)
            batch = submit(io.StringIO(_lines(rng, n, 0)), r=r, model="tiny")
            cancel_batch(r, batch.id)
            html = client.get(f"/dashboard/batches/{batch.id}").text
            assert f'href="/dashboard/batches/{batch.id}/errors.jsonl"' in html
            got = client.get(f"/dashboard/batches/{batch.id}/errors.jsonl")
            assert got.status_code == 200 and len(got.text.splitlines()) == n
            assert client.get("/dashboard/batches/batch_nope/errors.jsonl").status_code == 404
