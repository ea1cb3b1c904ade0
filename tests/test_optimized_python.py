"""The agent under ``python -OO`` (docstrings and asserts dropped: ~4 MB less RSS at start, see
docs/hardware-collectors.md): the command line and the served agent still work."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ENV = {**os.environ, "PYTHONOPTIMIZE": "2", "PYTHONDONTWRITEBYTECODE": "1"}


def test_help_under_OO():
    r = subprocess.run([sys.executable, "-OO", "-m", "cri_resmgr.cli", "--help"], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "cri-resmgr run|relay|nri" in r.stdout


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_agent_serves_under_OO(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"listen: 127.0.0.1:{port}\nstate_dir: {tmp_path}/s\nrun_dir: {tmp_path}/r\n")
    p = subprocess.Popen([sys.executable, "-OO", "-m", "cri_resmgr.cli", "run", "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
            try:
                if _get(base + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the agent did not answer /healthz"
            time.sleep(0.2)
        status, body = _get(base + "/metrics")
        assert status == 200 and b"# TYPE " in body
        status, body = _get(base + "/openapi.json")
        assert status == 200 and b'"/api/v1/series"' in body
        assert _get(base + "/api/v1/series?match%5B%5D=%7Bcpu%3D")[0] == 400  # bad input still answered as such
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
    assert rc == 0, p.stderr.read().decode() if p.stderr else ""
