"""Headless Chromium driven over the DevTools protocol: how long a page takes to show what a
person came for, how long its main thread froze, what it downloaded, the browser's memory,
and a screenshot.

    Chromium (--headless, --remote-debugging-port=0, nothing leaves this machine)
      └─ one tab ─ Page.navigate(url) ─ poll: does the page's text hold every expected string?
                   longtasks (PerformanceObserver), bytes received (Network events),
                   JS heap (Performance.getMetrics), PSS of every Chromium process (psutil)
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_catalog.errors import ShardflowError

# Long main-thread tasks (a frozen tab) from the page's first script on.
_LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) window.__longTasks.push(entry.duration);
}).observe({type: "longtask", buffered: true});
"""


@dataclass(frozen=True, kw_only=True)
class PageLoad:
    url: str
    usable_seconds: float | None
    """Until the page's text held every expected string; None: not within the limit."""
    longest_task_ms: float
    """The longest main-thread task: how long the tab froze at once."""
    blocked_ms: float
    """All main-thread tasks over 50 ms, summed."""
    received_bytes: int
    """Everything the page downloaded, as sent (encoded), until it was measured."""
    js_heap_bytes: int
    browser_pss_bytes: int
    """Proportional set size of every Chromium process: the browser's share of memory."""
    screenshot: str | None


def _chromium() -> str:
    found = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(found).exists():
        raise ShardflowError("Chromium is missing: `make test` installs Debian's chromium")
    return found


class Tab:
    """One tab of a headless Chromium, spoken to over its DevTools websocket."""

    def __init__(self, socket: Any, process: subprocess.Popen[bytes]) -> None:
        self.socket = socket
        self.process = process
        self.next_id = 0
        self.received = 0

    def call(self, method: str, timeout: float = 120.0, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("method") == "Network.loadingFinished":
                self.received += int(message["params"].get("encodedDataLength", 0))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise ShardflowError(f"Chromium: {method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str, timeout: float = 120.0) -> Any:
        done = self.call(
            "Runtime.evaluate", timeout=timeout, expression=expression, returnByValue=True
        )
        return done.get("result", {}).get("value")

    def pss_bytes(self) -> int:
        import psutil

        total = 0
        root = psutil.Process(self.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                total += int(getattr(process.memory_full_info(), "pss", 0))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total


@contextmanager
def chromium_tab(width: int = 1440, height: int = 1000) -> Iterator[Tab]:
    """A fresh headless Chromium (its own profile, no network beyond this machine's) and one
    tab of it."""
    from urllib.request import urlopen

    from websockets.sync.client import connect

    profile = Path(tempfile.mkdtemp(prefix="shardflow-chromium-"))
    process = subprocess.Popen(
        [
            _chromium(),
            *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"),
            *("--no-first-run", "--disable-background-networking"),
            *("--disable-component-update", "--disable-sync"),
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not active.exists() or len(active.read_text().splitlines()) < 2:
            if process.poll() is not None or time.monotonic() > deadline:
                raise ShardflowError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = active.read_text().splitlines()[0]
        with urlopen(f"http://127.0.0.1:{port}/json", timeout=30) as listing:
            pages = [t for t in json.load(listing) if t["type"] == "page"]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as socket:
            tab = Tab(socket, process)
            for domain in ("Page", "Runtime", "Performance", "Network"):
                tab.call(f"{domain}.enable")
            tab.call("Page.addScriptToEvaluateOnNewDocument", source=_LONG_TASKS)
            tab.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            yield tab
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(profile, ignore_errors=True)


def load_page(
    url: str,
    expect: Sequence[str],
    *,
    screenshot: Path | None = None,
    limit: float = 120.0,
    settle: float = 5.0,
) -> PageLoad:
    """Open ``url`` in a fresh browser; the seconds until the page's text holds every string
    of ``expect``; then, ``settle`` seconds later, what it froze, downloaded and holds."""
    wanted = json.dumps(list(expect))
    check = (
        "(() => { const text = document.body ? document.body.innerText : '';"
        f" return {wanted}.every((s) => text.includes(s)); }})()"
    )
    with chromium_tab() as tab:
        started = time.monotonic()
        tab.call("Page.navigate", url=url)
        usable: float | None = None
        while time.monotonic() - started < limit:
            if tab.evaluate(check, timeout=limit):
                usable = time.monotonic() - started
                break
            time.sleep(0.1)
        time.sleep(settle)
        long_tasks = tab.evaluate("window.__longTasks || []") or []
        metrics = {
            m["name"]: m["value"] for m in tab.call("Performance.getMetrics").get("metrics", [])
        }
        shot = None
        if screenshot is not None:
            png = tab.call("Page.captureScreenshot", format="png")["data"]
            screenshot.write_bytes(base64.b64decode(png))
            shot = str(screenshot)
        return PageLoad(
            url=url,
            usable_seconds=usable,
            longest_task_ms=max(long_tasks, default=0.0),
            blocked_ms=sum(long_tasks),
            received_bytes=tab.received,
            js_heap_bytes=int(metrics.get("JSHeapUsedSize", 0)),
            browser_pss_bytes=tab.pss_bytes(),
            screenshot=shot,
        )


def as_json(load: PageLoad) -> dict[str, Any]:
    return asdict(load)
