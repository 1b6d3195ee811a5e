"""`minfer viz`: the HTTP contract (errors are clear 4xx, the server survives them, a
live run streams per-node data over SSE) and the page in a real headless Chromium."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, sse_events

ARTIFACTS = Path(__file__).parent / "artifacts"
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="module")
def server(synth_model_path, tmp_path_factory):
    """A live `minfer viz` on the synth model, with a profile file, on a free loopback port."""
    env = dict(os.environ)
    prof = tmp_path_factory.mktemp("viz") / "profile.json"
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "profile", str(synth_model_path), "the cat", "-n", "2",
                        "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    prof.write_text(r.stdout)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minfer.cli", "viz", str(synth_model_path), "--port", str(port),
                             "--profile", str(prof)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/viz/info", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"minfer viz did not come up: {proc.stdout.read().decode(errors='replace')}")
        time.sleep(0.2)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_done(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/viz/info", timeout=5).json()["running"]:
        assert time.monotonic() < deadline, "run did not finish"
        time.sleep(0.1)


def test_bad_requests_get_clear_errors_and_the_server_survives(server):
    c = httpx.Client(base_url=server, timeout=10)
    n_nodes = len(c.get("/viz/graph").json()["nodes"])
    cases = [
        (c.get(f"/viz/node/{n_nodes}"), 404, "unknown node"),
        (c.get("/viz/node/x"), 400, "integer"),
        (c.get("/viz/graph?kind=sideways"), 400, "kind"),
        (c.get("/viz/graph?n=0"), 400, "n must be"),
        (c.post("/viz/run", content=b"{nope"), 400, "malformed JSON"),
        (c.post("/viz/run", json=["list"]), 400, "JSON object"),
        (c.post("/viz/run", json={"prompt": ""}), 400, "prompt"),
        (c.post("/viz/run", json={"prompt": "hi", "n": 0}), 400, "n must be"),
        (c.post("/viz/run", json={"prompt": "the cat " * 200, "n": 500}), 400, "exceeds the context"),
        (c.get("/viz/trace"), 404, "no trace"),
        (c.get("/no/such/page"), 404, "Not Found"),
        (c.get("/viz/run"), 405, ""),
    ]
    for resp, status, text in cases:
        assert resp.status_code == status, (resp.request.url, resp.text)
        assert text in resp.json()["error"]
    assert c.get("/viz/info").status_code == 200


def test_live_run_streams_node_data_and_refuses_a_second_run(server):
    c = httpx.Client(base_url=server, timeout=30)
    _wait_done(server)
    with c.stream("GET", "/viz/events") as sse:
        lines = sse.iter_lines()
        assert next(lines) == "event: hello"
        r = c.post("/viz/run", json={"prompt": "the cat sat", "n": 3})
        assert r.status_code == 202
        second = c.post("/viz/run", json={"prompt": "again", "n": 1})
        assert second.status_code == 409 and "already" in second.json()["error"]
        events = sse_events(lines, 60)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "done", events[-1]
    assert kinds.count("phase") == 2 and kinds.count("step") == 3
    phases = {d["kind"]: d["graph"] for e, d in events if e == "phase"}
    for e, d in events:
        if e == "step":
            g = phases[d["kind"]]
            executed = {n["id"] for n in g["nodes"] if not n["dead"] and n["op"] not in ("KvcacheStore", "KvcacheLoad")}
            assert {r["id"] for r in d["nodes"]} == executed
    done = events[-1][1]
    assert len(done["ids"]) == 3
    node = c.get("/viz/node/5?kind=decode").json()
    assert node["node"]["id"] == 5 and node["record"]["stats"] is not None
    assert c.get("/viz/live").json()["format"] == "minfer-trace"


def test_page_in_headless_chromium(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    graph = httpx.get(server + "/viz/graph", timeout=10).json()
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    profile_dir = tempfile.mkdtemp(prefix="minfer-chromium-")
    for f in CHROME_FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={profile_dir}")
    opts.add_argument("--window-size=1600,1000")
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    try:
        driver.set_page_load_timeout(60)
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "g.node")) > 0)
        nodes = driver.find_elements(By.CSS_SELECTOR, "g.node")
        assert len(nodes) == len(graph["nodes"])
        fused = [n["id"] for n in graph["nodes"] if n["fused"]]
        assert fused and len(driver.find_elements(By.CSS_SELECTOR, "g.node.fused")) == len(fused)
        target = next(n for n in graph["nodes"] if n["op"] == "MatMul")
        el = driver.find_element(By.CSS_SELECTOR, f'g.node[data-id="{target["id"]}"]')
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
        el.click()
        wait.until(lambda d: d.find_element(By.ID, "dname").text == target["name"])
        detail = driver.find_element(By.ID, "dtable").text
        assert target["op"] in detail and target["detail"] in detail
        assert "[" + ", ".join(str(x) for x in target["shape"]) + "]" in detail
        assert target["meta"]["weight_name"] in detail and "ms/step" in detail    # meta and the profile's time
        # A live run from the page: per-node data streams in over SSE and marks each
        # executed node; the detail panel then shows the selected node's stats.
        driver.find_element(By.ID, "n").clear()
        driver.find_element(By.ID, "n").send_keys("2")
        driver.find_element(By.ID, "run").click()
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith("done"))
        live = driver.execute_script("return S.graph")
        executed = [n for n in live["nodes"] if not n["dead"] and n["op"] not in ("KvcacheStore", "KvcacheLoad")]
        marked = driver.execute_script(
            "return [...document.querySelectorAll('g.node')].filter(g => g.querySelector('.dot').getAttribute('fill') !== 'none')"
            ".map(g => +g.getAttribute('data-id'))")
        assert live["kind"] == "decode" and sorted(marked) == sorted(n["id"] for n in executed)
        live_target = next(n for n in live["nodes"] if n["name"] == target["name"])
        el = driver.find_element(By.CSS_SELECTOR, f'g.node[data-id="{live_target["id"]}"]')
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
        el.click()
        wait.until(lambda d: d.find_element(By.ID, "dname").text == target["name"] and d.find_elements(By.ID, "stats"))
        assert "mean" in driver.find_element(By.ID, "stats").text
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "viz_page.png"
        assert driver.save_screenshot(str(shot))
        print(f"\nviz screenshot: {shot}")
        assert shot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_viz_cli_errors(synth_model_path, tmp_path, capsys):
    from minfer.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        assert main(["viz", str(synth_model_path), "--port", str(busy)]) == 1
        assert "cannot listen on 127.0.0.1:%d" % busy in capsys.readouterr().err
    assert main(["viz", str(synth_model_path), "--port", "0"]) == 2
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "minfer-profile", "version": 1, "phases": []}')
    assert main(["viz", str(synth_model_path), "--trace", str(bad)]) == 1
    assert "not a minfer-trace" in capsys.readouterr().err
