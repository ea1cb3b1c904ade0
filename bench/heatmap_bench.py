"""Heatmap endpoints on a 224-CPU node (fixture xeon-2s-112c-snc2) with 500 containers and 1 h of 1 s history,
served by uvicorn in a separate process, timed with a real HTTP client (httpx, keep-alive) from this one.

Baselines measured in the same run: ``/healthz`` (the HTTP floor of this server and client), ``/api/v1/topology``
(a plain JSON document of the same machine), and what a client without the heatmap endpoint must do: one
``/api/v1/query_range`` per row. Targets (issue 7): topology heatmap and time heatmap ≤ 50 ms each.

    .venv/bin/python bench/heatmap_bench.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import median_time  # noqa: F401  (puts the repo on sys.path)

N_CONTAINERS = 500
N_PINNED = 60  # Guaranteed, 2 CPUs (one core's threads) each; the other 440 share the remaining CPUs
HISTORY_SECONDS = 3600
REPEAT = 30


def build_agent(tmp: Path):
    import numpy as np

    from cri_resmgr.agent import Agent
    from cri_resmgr.collectors.cgroup import CgroupCollector, ContainerInfo, ContainerStats
    from cri_resmgr.collectors.identity import ContainerIdentity
    from cri_resmgr.config import build_config
    from cri_resmgr.topology import discover
    from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

    sysfs = build_sysfs(MACHINES["xeon-2s-112c-snc2"], tmp / "sys")
    cfg = build_config({"state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"), "listen": "127.0.0.1:0",
                        "store": {"checkpoint": False, "retention_seconds": HISTORY_SECONDS}}, env={})
    agent = Agent(cfg)
    agent.topology = topo = discover(sysfs)
    cpus = sorted(topo.cpus)
    cores = list(topo.cores().values())
    pinned_cpus = [frozenset(cores[i]) for i in range(N_PINNED)]
    shared = frozenset(cpus) - frozenset().union(*pinned_cpus)
    col = CgroupCollector(tmp / "cgroup")
    idents = []
    for i in range(N_CONTAINERS):
        uid = f"{i:08x}-0000-4000-8000-000000000000"
        cid = f"{i:064x}"
        qos = "Guaranteed" if i < N_PINNED else ("Burstable" if i % 2 else "BestEffort")
        ident = ContainerIdentity(cid, uid, qos, "containerd", f"/kubepods/pod{uid}/{cid}", name=f"c{i}",
                                  pod=f"pod-{i // 2}", namespace=f"ns{i % 10}")
        idents.append(ident)
        col.containers[cid] = ContainerInfo(ident, ContainerStats(cpu_usage_seconds=0.0, memory_usage_bytes=1 << 28,
                                                                  memory_working_set_bytes=1 << 27,
                                                                  cpuset=pinned_cpus[i] if i < N_PINNED else shared),
                                            last_seen=time.time())
    agent.collectors = {"cgroup": col}

    store = agent.store
    now = time.time()
    t0 = now - HISTORY_SECONDS + 1
    cpu_keys = [("cri_resmgr_cpu_busy_seconds_total", topo.cpu_labels(c)) for c in cpus] + \
               [("cri_resmgr_cpu_utilization_ratio", topo.cpu_labels(c)) for c in cpus]
    ct_keys = []
    for ident in idents:
        lab = ident.labels()
        ct_keys += [("cri_resmgr_container_cpu_usage_seconds_total", lab),
                    ("cri_resmgr_container_memory_working_set_bytes", lab)]
    h_cpu = store.prepare("cpu", cpu_keys, 1.0)
    h_ct = store.prepare("cgroup", ct_keys, 1.0)
    rng = np.random.default_rng(7)
    share = rng.random(len(cpus))
    usage_rate = rng.random(N_CONTAINERS) * 2
    busy = np.zeros(len(cpus))
    usage = np.zeros(N_CONTAINERS)
    ws = rng.random(N_CONTAINERS) * (1 << 30)
    for r in range(HISTORY_SECONDS):
        util = np.clip(share + rng.normal(0, 0.05, len(cpus)), 0, 1)
        busy += util
        usage += usage_rate * rng.random(N_CONTAINERS)
        h_cpu = store.write(h_cpu, t0 + r, np.concatenate([busy, util]))
        h_ct = store.write(h_ct, t0 + r, np.column_stack([usage, ws]).ravel())
    return agent


def serve(port_file: Path) -> None:
    import uvicorn

    from cri_resmgr.web.app import create_app
    from cri_resmgr.web.server import config

    tmp = Path(tempfile.mkdtemp(prefix="heatmap-bench-"))
    t = time.perf_counter()
    agent = build_agent(tmp)
    built = time.perf_counter() - t
    server = uvicorn.Server(config(create_app(agent), "127.0.0.1", 0, "warning"))

    async def main():
        await server.serve(sockets=[sock])

    import asyncio
    import socket

    # proto=IPPROTO_TCP, as uvicorn's own bind does: asyncio sets TCP_NODELAY on accepted sockets only when the
    # listening socket says TCP (asyncio.base_events._set_nodelay); without it Nagle + delayed ACK add ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    part = port_file.with_suffix(".part")
    part.write_text(json.dumps({"port": sock.getsockname()[1], "series": agent.store.series_count,
                                "build_seconds": built}))
    part.rename(port_file)  # atomic: the parent never reads half a file
    asyncio.run(main())


def timings(client, path: str, params: dict | None = None, repeat: int = REPEAT) -> tuple[list[float], int]:
    for _ in range(3):  # warm-up (connection, caches)
        r = client.get(path, params=params)
        r.raise_for_status()
    out = []
    size = 0
    for _ in range(repeat):
        t = time.perf_counter()
        r = client.get(path, params=params)
        r.raise_for_status()
        size = len(r.content)
        out.append(time.perf_counter() - t)
    return out, size


def main() -> None:
    import httpx

    port_file = Path(tempfile.mkdtemp(prefix="heatmap-bench-port-")) / "port.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    srv = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], env=env)
    try:
        deadline = time.time() + 600
        while not port_file.exists() or not port_file.read_text():
            if srv.poll() is not None or time.time() > deadline:
                raise SystemExit("benchmark server did not start")
            time.sleep(0.2)
        info = json.loads(port_file.read_text())
        base = f"http://127.0.0.1:{info['port']}"
        client = httpx.Client(base_url=base, timeout=120)
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        now = time.time()
        print(f"fixture: 224 CPUs (2 packages, SNC2, SST-BF), {N_CONTAINERS} containers ({N_PINNED} pinned), "
              f"{HISTORY_SECONDS} s of 1 s history, {info['series']} series; built in {info['build_seconds']:.1f} s")
        print(f"server: uvicorn in its own process; client: httpx keep-alive; {REPEAT} requests each after warm-up\n")
        print(f"{'request':<58} {'median':>9} {'p95':>9} {'bytes':>10}   target")
        rows = [
            ("baseline: /healthz (HTTP floor)", "/healthz", None, ""),
            ("baseline: /api/v1/topology (same machine, plain JSON)", "/api/v1/topology", None, ""),
            ("topology heatmap, utilisation (gauge)", "/api/v1/heatmap/topology",
             {"metric": "cri_resmgr_cpu_utilization_ratio"}, "<= 50 ms"),
            ("topology heatmap, busy seconds (counter -> rate)", "/api/v1/heatmap/topology",
             {"metric": "cri_resmgr_cpu_busy_seconds_total"}, "<= 50 ms"),
            ("topology heatmap at a past instant (at=now-1800)", "/api/v1/heatmap/topology",
             {"metric": "cri_resmgr_cpu_utilization_ratio", "at": now - 1800}, "<= 50 ms"),
            ("time heatmap by cpu, 1 h / 30 s (224 x 120)", "/api/v1/heatmap",
             {"metric": "cri_resmgr_cpu_utilization_ratio", "by": "cpu", "start": now - 3600, "end": now,
              "step": 30}, "<= 50 ms"),
            ("time heatmap by core, 1 h / 30 s, rate (112 x 120)", "/api/v1/heatmap",
             {"metric": "cri_resmgr_cpu_busy_seconds_total", "by": "core", "start": now - 3600, "end": now,
              "step": 30}, "<= 50 ms"),
            ("time heatmap by container, 1 h / 30 s, rate, top=50", "/api/v1/heatmap",
             {"metric": "cri_resmgr_container_cpu_usage_seconds_total", "by": "container", "start": now - 3600,
              "end": now, "step": 30, "top": 50}, "<= 50 ms"),
            ("time heatmap by container, 1 h / 30 s, rate, all 500", "/api/v1/heatmap",
             {"metric": "cri_resmgr_container_cpu_usage_seconds_total", "by": "container", "start": now - 3600,
              "end": now, "step": 30}, "<= 50 ms"),
            ("time heatmap by container, top=50, format=csv", "/api/v1/heatmap",
             {"metric": "cri_resmgr_container_cpu_usage_seconds_total", "by": "container", "start": now - 3600,
              "end": now, "step": 30, "top": 50, "format": "csv"}, "<= 50 ms"),
            ("time heatmap by cpu, 5 min / 1 s (224 x 300)", "/api/v1/heatmap",
             {"metric": "cri_resmgr_cpu_utilization_ratio", "by": "cpu", "start": now - 300, "end": now,
              "step": 1}, "<= 50 ms"),
        ]
        for label, path, params, target in rows:
            ts, size = timings(client, path, params)
            ts_ms = sorted(x * 1e3 for x in ts)
            p95 = ts_ms[int(0.95 * (len(ts_ms) - 1))]
            print(f"{label:<58} {statistics.median(ts_ms):>7.1f}ms {p95:>7.1f}ms {size:>10}   {target}")
        # Baseline: the same CPU matrix without the heatmap endpoint, one query_range per CPU row.
        t = time.perf_counter()
        for cpu in range(224):
            client.get("/api/v1/query_range", params={"metric": "cri_resmgr_cpu_utilization_ratio",
                                                      "match[]": f'{{cpu="{cpu}"}}', "start": now - 3600, "end": now,
                                                      "step": 30}).raise_for_status()
        per_row = (time.perf_counter() - t) * 1e3
        print(f"{'baseline: 224 x /api/v1/query_range, one per CPU row':<58} {per_row:>7.1f}ms {'(once)':>9}")
    finally:
        srv.terminate()
        srv.wait(30)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]))
    else:
        main()
