"""A headless Chromium driven through the Chrome DevTools Protocol, for the viewer's tests.

The browser is Debian's ``chromium`` package (``.ci/run`` installs it); nothing downloads one.
Every network request the page makes is recorded, so a test can assert there was none.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


needs_browser = pytest.mark.skipif(
    find_chromium() is None and not os.environ.get("QKV_REQUIRE_BROWSER"),
    reason="no chromium on PATH (.ci/run installs Debian's and sets QKV_REQUIRE_BROWSER)",
)


def page_data(html: str) -> Any:
    """The data the viewer's page carries (its ``qkv-data`` script), as Python."""
    found = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', html, re.S)
    assert found, "the page holds no qkv-data script"
    return json.loads(found.group(1))


class Browser:
    """One headless Chromium with one page; ``with Browser() as b: b.open(path)``."""

    def __init__(self, timeout: float = 30.0, width: int = 1400, height: int = 1000) -> None:
        import websocket  # websocket-client, a dev dependency

        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no chromium on PATH (apt-get install chromium)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="qkv-chromium-")
        args = [
            exe,
            "--headless=new",
            "--remote-debugging-port=0",
            "--no-first-run",
            f"--user-data-dir={self.profile}",
            "--disable-gpu",
            "--no-default-browser-check",
            f"--window-size={width},{height}",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root sandboxed
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        self.ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True
        )
        self.next_id, self.events = 0, []
        self.requests: list[str] = []
        self.send("Network.enable")
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Log.enable")  # failed loads (a missing image, a refused request)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a DevTools method and return its result (events seen meanwhile are kept)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)
        raise TimeoutError(method)

    def _event(self, message: dict[str, Any]) -> None:
        self.events.append(message)
        if message.get("method") == "Network.requestWillBeSent":
            self.requests.append(message["params"]["request"]["url"])

    def open(self, path: Path) -> float:
        """Load a file and wait for ``window.qkvView.ready``; returns the seconds taken."""
        t0 = time.monotonic()
        self.send("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait("window.qkvView && window.qkvView.ready === true")
        return time.monotonic() - t0

    def goto(self, url: str) -> None:
        """Load a URL and wait until it and everything it loads are in."""
        self.send("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'")

    def errors(self) -> list[dict[str, Any]]:
        """What went wrong so far: uncaught exceptions, console errors, failed loads."""
        return [
            e
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
            or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")
            or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
        ]

    def eval(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, condition: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.eval(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(condition)
            time.sleep(0.02)

    def center(self, selector: str) -> tuple[float, float]:
        box = self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
            "e.scrollIntoView({block: 'center'}); "
            # the first box: an inline element wrapped over two lines has two, and the
            # middle of their bounding rectangle can be outside both
            "const r = e.getClientRects()[0] || e.getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + "
            "r.height / 2]; })()"
        )
        return box[0], box[1]

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def hover(self, selector: str) -> None:
        x, y = self.center(selector)
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
