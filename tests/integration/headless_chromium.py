"""Open a page in headless Chromium and observe it through the DevTools protocol.

Chromium is started with ``--remote-debugging-pipe``: protocol messages are
NUL-terminated JSON on fds 3 (to the browser) and 4 (from it), so no port and
no websocket library are needed. One page target is attached in flat mode; the
console (Runtime.consoleAPICalled), uncaught exceptions (Runtime.exceptionThrown)
and browser-side log entries (Log.entryAdded: failed loads, security errors)
are collected while the page loads, and expressions are evaluated in the page.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class ConsoleMessage:
    source: str  # "console", "exception" or "log"
    level: str
    text: str


@dataclass
class Browser:
    """A headless Chromium process driven over the DevTools pipe."""
    binary: str
    profile_dir: Path
    timeout: float = 60.0
    messages: list[ConsoleMessage] = field(default_factory=list)
    _proc: subprocess.Popen | None = None
    _to: object = None
    _from: object = None
    _buf: bytes = b""
    _next_id: int = 0
    _session: str | None = None
    _events: list[dict] = field(default_factory=list)

    def __enter__(self) -> "Browser":
        to_r, to_w = os.pipe()      # we write, Chromium reads on fd 3
        from_r, from_w = os.pipe()  # Chromium writes on fd 4, we read

        def child_fds():
            # move both ends out of the way first: either may already be fd 3 or 4
            high_r = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        argv = [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile_dir}", "about:blank"]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=open(self.profile_dir / "chromium.stderr", "wb"),
                                      preexec_fn=child_fds, pass_fds=(3, 4))
        os.close(to_r)
        os.close(from_w)
        self._to = os.fdopen(to_w, "wb", buffering=0)
        self._from = os.fdopen(from_r, "rb", buffering=0)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.poll() is None:
                self._send("Browser.close", session=False)
        except (OSError, TimeoutError, RuntimeError):
            pass
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._to.close()
        self._from.close()

    # -- protocol -----------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = self._from.read(65536)
            if not chunk:
                raise RuntimeError(f"Chromium closed the DevTools pipe:\n{self.stderr_tail()}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self._session:
            msg["sessionId"] = self._session
        self._to.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._on_event(reply)

    def _on_event(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.messages.append(ConsoleMessage("console", params.get("type", ""), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.messages.append(ConsoleMessage("exception", "error", text))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.messages.append(ConsoleMessage("log", entry.get("level", ""), entry.get("text", "")))
        self._events.append(event)

    def _wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for i, ev in enumerate(self._events):
            if ev.get("method") == method:
                return self._events.pop(i)
        while True:
            ev = self._read_message(deadline)
            self._on_event(ev)
            if ev.get("method") == method:
                self._events.remove(ev)
                return ev

    # -- page ---------------------------------------------------------------
    def open(self, url: str) -> None:
        """Load ``url`` in a fresh page and wait for its load event."""
        target = self._send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self._session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                   session=False)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self._send(f"{domain}.enable")
        self._events.clear()
        self.messages.clear()
        self._send("Page.navigate", {"url": url})
        self._wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                 "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating {expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def errors(self) -> list[ConsoleMessage]:
        return [m for m in self.messages if m.level in ("error", "assert")]

    def stderr_tail(self, lines: int = 20) -> str:
        p = self.profile_dir / "chromium.stderr"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""


# One figure per <figure class="fig">: its inline <svg>'s rendered box and whether
# the browser parsed it as SVG (a broken one becomes an HTMLUnknownElement or is missing).
FIGURE_PROBE = """
[...document.querySelectorAll('figure.fig')].map(f => {
  const s = f.querySelector('svg');
  if (!s) return {svg: false, width: 0, height: 0, children: 0};
  const r = s.getBoundingClientRect();
  return {svg: s instanceof SVGSVGElement, width: r.width, height: r.height,
          children: s.querySelectorAll('path, text, use, line, rect, polyline, polygon').length};
})
"""


def inspect_report(binary: str, html_path: Path, profile_dir: Path) -> tuple[list[dict], list[ConsoleMessage]]:
    """Open a report; return (one probe per figure, console errors)."""
    profile_dir.mkdir(parents=True, exist_ok=True)
    with Browser(binary, profile_dir) as browser:
        browser.open(html_path.resolve().as_uri())
        # settle: a late error from a timer or a lazily decoded resource still counts
        browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 200)))")
        figures = browser.evaluate(FIGURE_PROBE)
        return figures, browser.errors()
