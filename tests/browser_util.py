"""Drive a real headless Chromium over the DevTools protocol (test helper).

No third-party deps: Chromium is started with ``--remote-debugging-pipe``;
it reads CDP commands from fd 3 and writes responses/events to fd 4, each
message being JSON terminated by a NUL byte.  Networking is disabled three
ways: an unreachable proxy, a host resolver that resolves nothing, and CDP
``Network.emulateNetworkConditions(offline=True)``.

Chromium lookup: ``$CHROMIUM_BIN`` / ``$CHROME_BIN``, then ``chromium``,
``chromium-browser``, ``google-chrome[-stable]``, ``chrome`` on PATH.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # CI containers run as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--proxy-server=127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--remote-debugging-pipe",
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_chromium() -> str | None:
    for var in ("CHROMIUM_BIN", "CHROME_BIN"):
        exe = os.environ.get(var)
        if exe and shutil.which(exe):
            return shutil.which(exe)
    for name in _CANDIDATES:
        exe = shutil.which(name)
        if exe:
            return exe
    return None


def require_chromium() -> str:
    """Chromium path; skip if absent locally, FAIL if absent under CI."""
    exe = find_chromium()
    if exe is None:
        msg = (
            "headless Chromium not found (looked at $CHROMIUM_BIN, $CHROME_BIN, "
            + ", ".join(_CANDIDATES)
            + "); install with: apt-get update && apt-get install -y chromium chromium-driver"
        )
        if in_ci():
            pytest.fail("CI is set but " + msg, pytrace=False)
        pytest.skip(msg)
    return exe


@dataclass
class PageReport:
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, failed loads
    warnings: list[str] = field(default_factory=list)
    value: Any = None  # result of the `check` expression
    ok: bool = False  # whether `check` became truthy before the timeout


class _Chromium:
    def __init__(self, exe: str, profile: str, log_path: Path):
        to_child_r, self._to_child_w = os.pipe()
        self._from_child_r, from_child_w = os.pipe()

        def _wire_fds() -> None:  # runs in the child: put the pipe ends on fds 3 and 4
            hi_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
            hi_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            close_fds=False,  # must keep fds 3/4 created by _wire_fds
            preexec_fn=_wire_fds,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_child_r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._replies[-1] = {"closed": True}
                    self._cond.notify_all()
                return
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for raw in msgs:
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cond:
                        self._replies[msg["id"]] = msg
                        self._cond.notify_all()
                else:
                    self._events.put(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._next_id += 1
        mid = self._next_id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._replies:
                if -1 in self._replies:
                    raise RuntimeError(f"chromium closed the pipe while waiting for {method}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no CDP reply to {method} within {timeout}s")
                self._cond.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise RuntimeError(f"CDP {method} failed: {reply['error']}")
        return reply.get("result", {})

    def events(self):
        while True:
            try:
                yield self._events.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_child_w, self._from_child_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()


def _describe(obj: dict) -> str:
    if "value" in obj:
        return str(obj["value"])
    return obj.get("description") or obj.get("unserializableValue") or obj.get("type", "?")


def _collect(ev: dict, report: PageReport) -> None:
    method, p = ev.get("method"), ev.get("params", {})
    if method == "Runtime.exceptionThrown":
        d = p["exceptionDetails"]
        exc = d.get("exception") or {}
        report.errors.append(f"uncaught exception: {exc.get('description') or d.get('text')}")
    elif method == "Runtime.consoleAPICalled":
        text = " ".join(_describe(a) for a in p.get("args", []))
        if p.get("type") in ("error", "assert"):
            report.errors.append(f"console.{p['type']}: {text}")
        elif p.get("type") == "warning":
            report.warnings.append(f"console.warn: {text}")
    elif method == "Log.entryAdded":
        e = p["entry"]
        line = f"{e.get('source')}: {e.get('text')} {e.get('url', '')}".strip()
        if e.get("level") == "error":
            report.errors.append(line)
        elif e.get("level") == "warning":
            report.warnings.append(line)


def load_page(
    path: str | Path,
    check: str = "true",
    *,
    until: Callable[[Any], bool] = bool,
    timeout: float = 30.0,
    settle: float = 0.5,
    width: int | None = None,
    height: int = 900,
    screenshot: str | Path | None = None,
) -> PageReport:
    """Open ``path`` offline in headless Chromium and report console problems.

    ``check`` is a JS expression (JSON-serialisable result) polled after the
    load event until ``until(value)`` holds or ``timeout`` expires; the last
    value is in ``report.value`` and ``report.ok`` says whether it held.
    ``width`` sets the viewport width in CSS pixels (``height`` its height);
    ``screenshot`` writes a full-page PNG after the check.
    """
    exe = require_chromium()
    url = Path(path).resolve().as_uri()
    report = PageReport()
    with tempfile.TemporaryDirectory(prefix="posprobe-chromium-") as profile:
        browser = _Chromium(exe, profile, Path(profile) / "chromium.log")
        try:
            target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            sid = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for method in ("Runtime.enable", "Log.enable", "Page.enable", "Network.enable"):
                browser.send(method, session=sid)
            try:  # belt and braces on top of the proxy/resolver flags; may be deprecated
                browser.send(
                    "Network.emulateNetworkConditions",
                    {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
                    session=sid,
                )
            except RuntimeError:
                pass
            if width:
                browser.send("Emulation.setDeviceMetricsOverride",
                             {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=sid)
            browser.send("Page.navigate", {"url": url}, session=sid)
            deadline = time.monotonic() + timeout
            loaded = False
            while time.monotonic() < deadline:
                for ev in browser.events():
                    loaded |= ev.get("method") == "Page.loadEventFired"
                    _collect(ev, report)
                if loaded:
                    res = browser.send(
                        "Runtime.evaluate", {"expression": check, "returnByValue": True}, session=sid
                    )
                    report.value = res.get("result", {}).get("value")
                    if "exceptionDetails" not in res and until(report.value):
                        report.ok = True
                        break
                time.sleep(0.1)
            time.sleep(settle)  # let late errors (async rendering) arrive
            for ev in browser.events():
                _collect(ev, report)
            if screenshot is not None:
                import base64

                shot = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                                    session=sid, timeout=60)
                Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        finally:
            browser.close()
    return report
