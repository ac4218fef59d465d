"""Headless Chromium driven over the DevTools protocol (aiohttp's websocket client): enough
to load a page, read its DOM and take a screenshot, with no browser-driver dependency."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
         "--hide-scrollbars")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """``async with Browser(path, tmp) as page: await page.goto(url)``"""

    def __init__(self, executable: str, profile: Path, width: int = 1280, height: int = 900):
        self.executable, self.profile = executable, profile
        self.size = (width, height)
        self.proc: subprocess.Popen | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Browser":
        self.profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.executable, *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", f"--window-size={self.size[0]},{self.size[1]}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(self.profile / "chromium.log", "wb"))
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        # Chromium writes the file in place, "PORT\nPATH": only both lines are a whole port.
        while not (port_file.exists() and len(port_file.read_text().split("\n")) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start: "
                                   + (self.profile / "chromium.log").read_text()[-2000:])
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json(content_type=None)
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Emulation.setDeviceMetricsOverride", width=self.size[0],
                        height=self.size[1], deviceScaleFactor=1, mobile=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()
        await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def send(self, method: str, **params) -> dict:
        call_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive(timeout=60)).data)
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout: float = 60.0) -> None:
        """Wait until ``expression`` is truthy in the page."""
        deadline = time.monotonic() + timeout
        while True:
            if await self.evaluate(f"Boolean({expression})"):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.25)

    async def screenshot(self, path: Path) -> None:
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.send("Emulation.setDeviceMetricsOverride", width=self.size[0],
                        height=max(self.size[1], int(height)), deviceScaleFactor=1,
                        mobile=False)
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
