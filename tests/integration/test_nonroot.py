"""Without root the agent still starts: default directories fall back to per-user ones."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from .helpers import free_port, wait_for

pytestmark = pytest.mark.integration

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def _interpreter_for_nobody() -> str | None:
    """The venv's interpreter may live under a root-only home (pyenv in /root); the system python of the
    same version with the venv's site-packages on PYTHONPATH runs the same code."""
    for cand in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", cand, "-c", "1"],
                           capture_output=True)
        if r.returncode == 0:
            return cand
    return None


@pytest.fixture
def nobody_python():
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as another user")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) not installed")
    py = _interpreter_for_nobody()
    if py is None:
        pytest.skip("no Python interpreter executable by user nobody")
    return py


@pytest.fixture
def open_tmp():
    # pytest's tmp_path sits under a 0700 directory of root's; nobody needs to read the config.
    d = Path(tempfile.mkdtemp(prefix="cri-resmgr-nonroot-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class NobodyAgent:
    """The agent started as user nobody with its default directories, so it must fall back to XDG ones."""

    def __init__(self, tmp: Path, python: str, config: dict):
        self.home = tmp / "home"
        self.home.mkdir()
        os.chown(self.home, NOBODY, NOBODY)
        self.port = free_port()
        cfg = tmp / "c.yaml"
        cfg.write_text(yaml.safe_dump({"listen": f"127.0.0.1:{self.port}", **config}))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
               "XDG_RUNTIME_DIR": str(self.home / "run"), "XDG_STATE_HOME": str(self.home / "state"),
               "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])}
        self.log = tmp / "agent.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python,
                 "-m", "cri_resmgr.cli", "run", "--config", str(cfg)],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.home)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(self.log.read_text())
            try:
                return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=30, what="non-root agent ready")

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(20)


def test_agent_starts_without_root_using_fallback_dirs(open_tmp, nobody_python):
    agent = NobodyAgent(open_tmp, nobody_python,
                        {"collectors": {"cgroup": {"interval_seconds": 0.5}, "cpu": {"interval_seconds": 0.5}}})
    home = agent.home
    try:
        agent.wait_ready()
        cols = {c["name"]: c for c in httpx.get(agent.url + "/api/v1/collectors").json()}
        assert cols["cpu"]["up"] and cols["cgroup"]["up"]
        for c in cols.values():
            assert c["up"] or c["reason"], c  # a collector that is down says why
        text = agent.log.read_text()
        assert "not writable" in text and str(home / "run" / "cri-resmgr") in text
        assert (home / "run" / "cri-resmgr" / "cri-resmgr.lock").exists()
    finally:
        assert agent.stop() == 0
    assert (home / "state" / "cri-resmgr" / "store.npz").exists()  # checkpoint written as that user
