"""Regenerate docs/viz.png: `minfer viz` on the default model with a trace and a
profile opened, one node selected, captured by headless Chromium.

    MINFER_CACHE=... python docs/viz_screenshot.py TRACE.json PROFILE.json [NODE_NAME]
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def main() -> int:
    trace, profile = sys.argv[1], sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else "blk.0.ffn_act"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minfer.cli", "viz", "--port", str(port), "--trace", trace,
                             "--profile", profile])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/viz/info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for f in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", f"--user-data-dir={tempfile.mkdtemp()}",
                  "--window-size=1500,900"):
            opts.add_argument(f)
        d = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
        try:
            d.get(base + "/")
            wait = WebDriverWait(d, 120)
            wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
            nid = d.execute_script(f"return S.graph.nodes.find(n => n.name === {name!r}).id")
            d.execute_script(f"select({nid})")
            out = Path(__file__).parent / "viz.png"
            d.save_screenshot(str(out))
            print(out)
        finally:
            d.quit()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
