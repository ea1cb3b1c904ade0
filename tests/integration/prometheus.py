"""A real Prometheus server (Debian package ``prometheus``) started by a test on loopback, with its own data dir."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from .helpers import free_port

PROMETHEUS = shutil.which("prometheus")


def missing_reason() -> str | None:
    if PROMETHEUS is None:
        return "prometheus server not installed (Debian package prometheus; make test installs it as root)"
    return None


class PrometheusServer:
    def __init__(self, tmp: Path, scrape_targets: list[str] | None = None, scrape_interval: str = "1s",
                 remote_write_receiver: bool = False, job: str = "cri-resmgr"):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config_path = self.tmp / "prometheus.yml"
        cfg: dict = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval}}
        if scrape_targets:
            cfg["scrape_configs"] = [{"job_name": job, "static_configs": [{"targets": scrape_targets}]}]
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.args = [PROMETHEUS, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.tmp / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        if remote_write_receiver:
            self.args.append("--web.enable-remote-write-receiver")
        self.log_path = self.tmp / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    def start(self, timeout: float = 60) -> PrometheusServer:
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout}s:\n{self.log_path.read_text()}")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def targets_up(self) -> bool:
        r = httpx.get(self.url + "/api/v1/targets", timeout=5).json()
        active = r["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
