"""Headless Chromium driven over the DevTools protocol, for the dashboard's browser test."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from jobs_helpers import wait_for

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
        for domain in ("Page", "Network", "Runtime", "Log"):
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
        return wait_for(lambda: self._between_pages(expression), timeout, what, every=0.2)

    def _between_pages(self, expression: str) -> Any:
        """``js(expression)``, or None while a navigation (a clicked link) replaces the page it ran in."""
        try:
            return self.js(expression)
        except AssertionError as e:
            if "Inspected target navigated or closed" in str(e) or "Cannot find context" in str(e):
                return None
            raise

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.until("document.readyState === 'complete' && !!document.body.dataset.view", f"{url} to load")

    def type_key(self, key: str) -> None:
        self.js("document.getElementById('key').focus()")
        self.call("Input.insertText", text=key)
        self.js("document.querySelector('#login-form button[type=submit]').click()")

    def urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def problems(self, since: int = 0) -> list[str]:
        """The errors a user would see in the DevTools console, among the events from ``since`` on: console
        errors, uncaught exceptions, the browser's own error entries (a CSP violation, a resource that did
        not load), failed requests and responses >= 400. A request cancelled by leaving the page is none."""
        out = []
        for e in self.events[since:]:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p.get('args', [])]}")
            elif method == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                out.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
            elif method == "Network.loadingFailed" and not p.get("canceled"):
                out.append(f"request failed: {p.get('errorText')} ({p.get('type')})")
            elif method == "Network.responseReceived" and p["response"]["status"] >= 400:
                out.append(f"HTTP {p['response']['status']}: {p['response']['url']}")
        return out

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


