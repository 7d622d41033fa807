"""The dashboard (api/dashboard.py): pages without data, fragments behind the API key, signed download
links, the rate-sample ring, 10,000 batches paged. In a real browser: tests/api/test_dashboard_browser.py."""

from __future__ import annotations

import io
import json
import random
import re
import secrets
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_api_helpers import simple_lines, sluice_home
from fastapi.testclient import TestClient
from helpers import fresh_seed
from sluice.api.app import create_app
from sluice.api.dashboard import HEADERS, PAGE_SIZE, download_url
from sluice.api.rate_samples import MIN_GAP, SIZE, RateSamples
from sluice.api.settings import Settings
from sluice.jobs.schemas import Batch, BatchCounts, BatchStatus, ResultUsage
from sluice.jobs.store import cancel_batch, count_batches, get_batch
from sluice.jobs.submit import submit

KEY = "sk-dash-" + secrets.token_hex(8)
ROOT = Path(__file__).resolve().parents[2]


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
        text = f.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, never fetched
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f
        assert not re.search(r"<script>|\son\w+=", text), f
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        got = api.get(f"/dashboard/static/{name}", key=None)
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind)
    assert api.get("/dashboard/static/..%2Fdashboard.py", key=None).status_code == 404


def test_session_says_whether_a_key_is_needed_with_no_error_and_the_icon_is_served(api: Api, tmp_path: Path) -> None:
    """The page's question (issue 42, item 6): 200 with or without the right key; the icon at both paths."""
    for key, authorized in ((None, False), ("sk-wrong", False), (KEY, True)):
        got = api.get("/dashboard/session", key=key)
        assert got.status_code == 200 and got.json() == {"key_required": True, "authorized": authorized}, key
    assert api.client.get("/dashboard/session", headers={"x-api-key": KEY}).json()["authorized"] is True
    with sluice_home(tmp_path / "home"):
        app = create_app(Settings(api_key=None, files_dir=tmp_path / "files"))
        with TestClient(app) as client:
            assert client.get("/dashboard/session").json() == {"key_required": False, "authorized": True}
    page = api.get("/", key=None).text
    assert '<link rel="icon" href="/dashboard/static/favicon.svg" type="image/svg+xml">' in page
    for path in ("/favicon.ico", "/dashboard/static/favicon.svg"):
        icon = api.get(path, key=None)
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml"), path
        assert icon.text.startswith("<svg ") and icon.text.rstrip().endswith("</svg>")


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
    # Not the API's background webhook deliverer (a script each second, api/webhooks.py): pages run no script.
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k not in ("cmdstat_info", "cmdstat_evalsha"))


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
