"""Render a page in a real headless chromium over the DevTools protocol: wait until its
bokeh document is rendered, collect console messages and uncaught exceptions with their
levels, and take a screenshot. Speaks the protocol with tornado's websocket client
(tornado comes with Dask)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

#: true once every bokeh document on the page has rendered its views
_RENDERED = ("(() => { const B = window.Bokeh; if (!B || !B.documents || !B.documents.length) return false;"
             " return B.documents.every(d => d.roots().length > 0) && B.index && Object.keys(B.index).length > 0; })()")


async def _session(ws_url, url, png, width, height, timeout):
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(ws_url, max_message_size=256 * 1024 * 1024)
    ids = iter(range(1, 1 << 30))
    messages, pending = [], {}

    async def call(method, **params):
        i = next(ids)
        await ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            raw = await asyncio.wait_for(ws.read_message(), timeout)
            if raw is None:
                raise RuntimeError("chromium closed the DevTools connection")
            m = json.loads(raw)
            if m.get("id") == i:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            _event(m)

    def _event(m):
        p = m.get("params", {})
        if m.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            messages.append((p.get("type"), text))
        elif m.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            messages.append(("exception", d.get("exception", {}).get("description") or d.get("text")))
        elif m.get("method") == "Log.entryAdded":
            e = p.get("entry", {})
            messages.append((e.get("level"), e.get("text")))

    await call("Runtime.enable")
    await call("Log.enable")
    await call("Page.enable")
    await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
    await call("Page.navigate", url=url)
    deadline = time.monotonic() + timeout
    rendered = False
    while time.monotonic() < deadline:
        r = await call("Runtime.evaluate", expression=_RENDERED, returnByValue=True)
        if r.get("result", {}).get("value") is True:
            rendered = True
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(1.0)  # let the canvases paint
    await call("Runtime.evaluate", expression="1")  # collect what arrived meanwhile
    shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    with open(png, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    ws.close()
    return rendered, messages


def render(url: str, png: str, width: int = 1400, height: int = 2400, timeout: float = 60.0):
    """``(rendered, [(level, text), ...])`` of ``url`` in headless chromium; the screenshot goes to ``png``."""
    assert CHROMIUM, "chromium is needed (apt-get install chromium; .ci/run installs it)"
    profile = tempfile.mkdtemp(prefix="dlspark-chromium-")
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        t_end = time.monotonic() + timeout
        while port is None and time.monotonic() < t_end:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError("chromium exited before its DevTools endpoint was up")
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                port = int(m.group(1))
        # keep reading its log, or chromium blocks on a full pipe
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
            page = next(t for t in json.loads(resp.read()) if t.get("type") == "page")
        return asyncio.run(_session(page["webSocketDebuggerUrl"], url, png, width, height, timeout))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
