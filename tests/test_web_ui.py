"""The web UI in a real browser: Debian's headless Chromium driven by Playwright, against the agent's app served
by uvicorn on loopback. Checks that the page loads without console errors, that the topology cells and the time
heatmap show the values the API returns for the same instant, that the container table lists the containers,
and that live refresh picks up new data. A screenshot is kept in tests/artifacts/."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from cri_resmgr.web.app import create_app

from .integration.helpers import free_port
from .nodefixture import FixtureContainer, FixtureNode, kubepods

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                                reason="Debian package chromium is not installed (make test installs it as root)")

CONTAINERS = [
    kubepods("1", "a", "0-3,112-115", qos="guaranteed"),
    kubepods("2", "b", "8-111,120-223"),
    FixtureContainer("demo/avx512", "4-5", name="avx512-loop", namespace="demo", pod="avx512"),
    FixtureContainer("demo/scalar", "6-7", name="scalar-loop", namespace="demo", pod="scalar"),
]


class Served:
    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def node(tmp_path):
    n = FixtureNode(tmp_path, "xeon-2s-112c-snc2", CONTAINERS).start()
    n.feed({})
    for k in range(3):
        time.sleep(0.3)
        n.feed({c: ((c + k) % 10) / 10 for c in n.cpus},
               usage_step_ns={CONTAINERS[0].rel: 2_000_000_000, CONTAINERS[2].rel: 900_000_000})
    yield n
    n.stop()


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (PyPI) is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def shown_percent(text: str) -> float:
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)%", text.strip())
    assert m, f"cell text {text!r} is not a percentage"
    return float(m.group(1))


def cells_match_api(page, url) -> int:
    """Compare every topology cell with the API's answer for the instant the page asked about."""
    svg = page.locator("svg#topology")
    at, metric = svg.get_attribute("data-at"), svg.get_attribute("data-metric")
    api = httpx.get(url + "/api/v1/heatmap/topology", params={"metric": metric, "at": at}).json()
    expect = {t["cpu"]: t for p in api["packages"] for d in p["dies"] for c in d["cores"] for t in c["threads"]}
    cells = page.eval_on_selector_all(
        "svg#topology g.cell",
        "gs => gs.map(g => [Number(g.dataset.cpu), g.dataset.value, g.querySelector('text.val').textContent,"
        " g.dataset.sst, Number(g.dataset.containers)])")
    assert len(cells) == len(expect) == 224
    with_value = 0
    for cpu, value, text, sst, n_containers in cells:
        t = expect[cpu]
        assert (sst or None) == t["sst_priority"], cpu
        assert n_containers == len(t["containers"]), cpu
        if t["value"] is None:
            assert value == "" and text == "–", (cpu, value, text)
            continue
        with_value += 1
        assert float(value) == pytest.approx(t["value"]), cpu
        assert shown_percent(text) == pytest.approx(round(t["value"] * 100, 1), abs=0.051), (cpu, text)
    return with_value


def test_ui_shows_what_the_api_returns(node, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    with Served(create_app(node.agent)) as srv:
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
        page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
        page.goto(srv.url + "/ui/")
        page.wait_for_selector("body[data-refreshes]", timeout=20_000)
        assert not errors, errors
        assert page.title() == "cri-resmgr"
        assert page.locator("#node").inner_text() == "· fixture-node"

        # Topology grid: every CPU, values as the API has them at the page's instant.
        assert cells_match_api(page, srv.url) == 224
        chips = page.eval_on_selector_all("#collectors .chip", "cs => cs.map(c => [c.dataset.collector, c.className])")
        assert ["cgroup", "chip up"] in chips and ["cpu", "chip up"] in chips

        # Time heatmap: hover cells and read the tooltip; same query as the page's.
        canvas = page.locator("canvas#heatmap")
        d = canvas.evaluate("c => ({...c.dataset})")
        assert d["metric"] == "cri_resmgr_container_cpu_usage_seconds_total" and d["by"] == "container"
        params = {"metric": d["metric"], "by": d["by"], "start": d["start"], "end": d["end"], "step": d["step"],
                  "top": d["top_n"]}
        hm = httpx.get(srv.url + "/api/v1/heatmap", params=params).json()
        assert int(d["rows"]) == len(hm["rows"]) == 4 and int(d["cols"]) == len(hm["times"])
        box = canvas.bounding_box()
        checked = 0
        for i, row in enumerate(hm["rows"]):
            for j in range(len(hm["times"]) - 1, -1, -1):
                if hm["values"][i][j] is None:
                    continue
                x = float(d["left"]) + (j + 0.5) * float(d["cellW"])
                y = float(d["top"]) + (i + 0.5) * float(d["cellH"])
                page.mouse.move(box["x"] + x, box["y"] + y)
                tip = page.locator("#hm-tip")
                assert tip.get_attribute("data-row") == row
                assert float(tip.get_attribute("data-value")) == pytest.approx(hm["values"][i][j])
                assert tip.inner_text().startswith(f"{row} · ")
                checked += 1
                break
        assert checked >= 2  # the two containers whose usage advanced have rates
        csv_href = page.locator("#hm-csv").get_attribute("href")
        assert "format=csv" in csv_href and httpx.get(csv_href).text.splitlines()[0].startswith("row,")

        # Container table.
        ids = page.eval_on_selector_all("#containers tbody tr", "rs => rs.map(r => r.dataset.id)")
        api_ids = [c["container_id"] for c in httpx.get(srv.url + "/api/v1/containers").json()]
        assert sorted(ids) == sorted(api_ids) and len(ids) == 4
        # Clicking a CPU keeps only the containers placed on it.
        page.locator('svg#topology g.cell[data-cpu="4"]').click()
        visible = page.eval_on_selector_all("#containers tbody tr:not(.hidden)", "rs => rs.map(r => r.dataset.id)")
        assert visible == ["avx512-loop"]
        page.locator('svg#topology g.cell[data-cpu="4"]').click()
        page.screenshot(path=str(ARTIFACTS / "web-ui.png"), full_page=True)

        # Live refresh: new data arrives, the page shows it without a reload.
        page.select_option("#refresh", "2")
        time.sleep(0.3)
        node.feed({c: 0.25 if c % 2 else 0.75 for c in node.cpus})
        fed = time.time()
        page.wait_for_function(f"Number(document.querySelector('svg#topology').dataset.at) > {fed}", timeout=10_000)
        page.wait_for_function("document.body.dataset.refreshes >= 2", timeout=10_000)
        assert cells_match_api(page, srv.url) == 224
        shown = page.eval_on_selector_all("svg#topology g.cell", "gs => gs.slice(0, 4).map(g => g.dataset.value)")
        assert [float(v) for v in shown] == pytest.approx([0.75, 0.75, 0.25, 0.25])  # cpus 0, 112, 1, 113
        page.screenshot(path=str(ARTIFACTS / "web-ui-refreshed.png"), full_page=True)
        assert not errors, errors


def test_ui_files_are_served_and_root_redirects(node):
    from fastapi.testclient import TestClient

    c = TestClient(create_app(node.agent))
    r = c.get("/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/ui/"
    assert c.get("/ui", follow_redirects=True).text.startswith("<!doctype html>")
    for f, ctype in (("app.js", "javascript"), ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        r = c.get(f"/ui/{f}")
        assert r.status_code == 200 and ctype in r.headers["content-type"], f
    html = c.get("/ui/").text
    assert "http://" not in html and "https://" not in html  # nothing from a CDN


def test_ui_asks_for_the_read_token_and_sends_it_only_as_a_header(tmp_path, browser):
    """With api.read_token set, the page loads, asks for the token, refuses a wrong one with the reason, then
    shows the node's data; the token goes in the Authorization header of API calls, never in a URL, and the CSV
    link works with it."""
    read = "ui-read-token-0123456789"
    n = FixtureNode(tmp_path, "xeon-2s-112c-snc2", CONTAINERS, api={"read_token": read}).start()
    try:
        n.feed({})
        time.sleep(0.3)
        n.feed({c: 0.5 for c in n.cpus}, usage_step_ns={CONTAINERS[0].rel: 1_000_000_000})
        with Served(create_app(n.agent)) as srv:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            requests: list[tuple[str, str | None]] = []
            page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization"))))
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(srv.url + "/ui/")
            page.wait_for_selector("#login:not([hidden])", timeout=20_000)
            assert "asks for a read token" in page.locator("#login-reason").inner_text()
            assert page.locator("body[data-refreshes]").count() == 0  # nothing shown without the token

            page.fill("#token", "wrong-token")
            page.click("#login button[type=submit]")
            page.wait_for_function("document.querySelector('#login-reason').textContent.includes('not accepted')",
                                   timeout=10_000)
            assert not page.locator("#login").is_hidden()

            page.fill("#token", read)
            page.click("#login button[type=submit]")
            page.wait_for_selector("body[data-refreshes]", timeout=20_000)
            assert page.locator("#login").is_hidden()
            assert page.locator("#node").inner_text() == "· fixture-node"
            assert page.locator("svg#topology g.cell").count() == 224
            assert page.locator("#containers tbody tr").count() == 4

            # The CSV link: the browser fetches it with the header and saves it.
            with page.expect_download(timeout=10_000) as dl:
                page.click("#hm-csv")
            assert Path(dl.value.path()).read_text().splitlines()[0].startswith("row,")

            api_calls = [(u, h) for u, h in requests if "/api/" in u]
            assert api_calls and all(read not in u and "wrong-token" not in u for u, _ in requests)
            after = [h for u, h in api_calls[-5:]]
            assert after == [f"Bearer {read}"] * len(after), after
            assert not errors, errors
    finally:
        n.stop()


PLAN_CONTAINERS = [
    kubepods("1", "a", "0-3,112-115", qos="guaranteed"),
    kubepods("2", "b", "8-111,120-223"),
    FixtureContainer("demo/avx512", "4-7,116-119", name="avx512-loop", namespace="demo", pod="avx512"),
    FixtureContainer("demo/scalar", "4-7,116-119", name="scalar-loop", namespace="demo", pod="scalar"),
]


def test_plan_view_outlines_the_moves_and_the_table_shows_hardware_columns(tmp_path, browser):
    """An AVX-512 loop and a latency-critical loop share cores 4-7: the agent's own rebalancer round (advise)
    plans a move; the page lists it with its explanation and outlines where it starts and where it goes."""
    from cri_resmgr.config import RebalancerOverride
    from cri_resmgr.store import Sample

    node = FixtureNode(tmp_path, "xeon-2s-112c-snc2", PLAN_CONTAINERS).start()
    try:
        engine = node.agent.rebalancer.engine
        rcfg = node.agent.cfg.rebalancer.model_copy(update={"overrides": [
            RebalancerOverride(match={"container": "avx512-loop"}, avx512_ratio=1.0),
            RebalancerOverride(match={"container": "scalar-loop"}, latency_critical=True)]})
        engine.config = lambda: rcfg  # the round's configuration, as a reload would give it
        node.feed({})
        for _ in range(3):
            time.sleep(0.3)
            node.feed({c: 0.5 for c in node.cpus}, usage_step_ns={PLAN_CONTAINERS[2].rel: 1_000_000_000,
                                                                  PLAN_CONTAINERS[3].rel: 1_000_000_000})
        # Hardware series as the avx512/perf/rdt collectors write them, every 5 s.
        now = node.agent.now()
        for k, t in enumerate((now - 10, now - 5, now)):
            node.agent.store.append("hw", t, [
                Sample("cri_resmgr_container_avx512_ratio", {"container_id": "avx512-loop"}, 0.93),
                Sample("cri_resmgr_container_llc_misses_total", {"container_id": "avx512-loop"}, 2e6 * 5 * k),
                Sample("cri_resmgr_container_memory_bandwidth_bytes_total",
                       {"container_id": "avx512-loop", "scope": "total", "cache_id": "0"}, 3e9 * 5 * k),
            ], 5.0)
        rec = node.agent.rebalancer.run_now("advise")
        assert rec.plan is not None and rec.plan.moves, rec
        with Served(create_app(node.agent)) as srv:
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
            page.goto(srv.url + "/ui/")
            try:
                page.wait_for_selector("body[data-refreshes]", timeout=20_000)
            finally:
                assert not errors, (errors, page.locator("#status").inner_text())
            api = httpx.get(srv.url + "/api/v1/rebalancer/plan").json()["last"]["plan"]
            rows = page.eval_on_selector_all(
                "#moves tbody tr", "rs => rs.map(r => [r.dataset.id, r.querySelector('.fromto').textContent,"
                " r.querySelector('.separates').textContent, r.querySelector('.terms').textContent])")
            assert [r[0] for r in rows] == [m["container_id"] for m in api["moves"]]
            for (_cid, fromto, seps, terms), m in zip(rows, api["moves"], strict=True):
                assert fromto == f"{m['from_cpus']} → {m['to_cpus']}"
                for s in m["separates"]:  # who hurts whom, as the plan says
                    assert f"{s['victim']} ← {s['antagonist']} ({s['term']}" in seps
                assert all(term in terms for term, v in m["gain_by_term"].items() if abs(v) > 1e-9)
            assert any("scalar-loop ← avx512-loop" in r[2] for r in rows)
            # The selected move outlined on the topology: dashed where it starts, solid where it goes.
            for move in api["moves"]:
                page.locator(f'#moves tbody tr[data-id="{move["container_id"]}"]').click()
                cpus_of = "gs => gs.map(g => Number(g.dataset.cpu))"
                starts = page.eval_on_selector_all("svg#topology g.cell.plan-from", cpus_of)
                goes = page.eval_on_selector_all("svg#topology g.cell.plan-to", cpus_of)
                assert set(starts) == parse_list(move["from_cpus"]) and set(goes) == parse_list(move["to_cpus"])
                page.select_option("#plan-view", "after")
                assert not page.eval_on_selector_all("svg#topology g.cell.plan-from", "gs => gs.length")
                page.select_option("#plan-view", "both")
            page.screenshot(path=str(ARTIFACTS / "web-ui-plan.png"), full_page=True)
            # Hardware columns: the newest AVX-512 ratio, LLC miss rate and bandwidth of each container.
            avx = page.locator('#containers tr[data-id="avx512-loop"] td.avx')
            assert avx.inner_text() == "93.0%"
            assert float(page.locator('#containers tr[data-id="avx512-loop"] td.llc').get_attribute("data-value")) \
                == pytest.approx(2e6)
            assert float(page.locator('#containers tr[data-id="avx512-loop"] td.bw').get_attribute("data-value")) \
                == pytest.approx(3e9)
            assert page.locator('#containers tr[data-id="scalar-loop"] td.avx').inner_text() == "–"
            # A 5 s metric is never shown at steps shorter than 5 s (no empty columns in between).
            page.select_option("#hm-metric", "cri_resmgr_container_avx512_ratio")
            page.wait_for_function("document.querySelector('canvas#heatmap').dataset.metric"
                                   " === 'cri_resmgr_container_avx512_ratio'", timeout=10_000)
            assert float(page.locator("canvas#heatmap").get_attribute("data-step")) >= 5.0
            assert not errors, errors
    finally:
        node.stop()


def parse_list(text: str) -> set[int]:
    from cri_resmgr.sysfs import parse_cpulist

    return set(parse_cpulist(text))
