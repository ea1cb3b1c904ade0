"""A private, real containerd for tests: its own root, state, socket and cgroup parent, local images only.

Debian's containerd 1.6 + runc are started by hand with a config derived from ``containerd config default``:

- ``root``/``state``/``grpc.address`` (and the ``opt`` plugin path) under a temporary directory, so nothing
  touches a containerd the host may run;
- the CRI plugin with the cgroupfs driver (``SystemdCgroup = false``: there is no systemd here),
  ``restrict_oom_score_adj = true`` (without it runc fails to write the sandbox's ``oom_score_adj`` here:
  the test sandbox lacks CAP_SYS_RESOURCE), a private CNI directory (pods use the host network, so CNI is
  never called) and ``sandbox_image`` pointing at a locally built image;
- images are built here from ``busybox-static`` as docker-archive tars (the ``docker save`` layout that
  containerd's ``images/archive`` importer reads: ``manifest.json`` + image config + uncompressed layer tar)
  and imported with ``ctr -n k8s.io images import``. Nothing is pulled: the machine has no registry access.

containerd leaves ``cgroup_parent`` directories behind after the containers in them are removed, and the
runc shims outlive a killed containerd; :meth:`Containerd.cleanup` removes both (only ours: shims are
recognised by our private socket path on their command line).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .helpers import stop_process

BUSYBOX = Path("/bin/busybox")
BINARIES = ("containerd", "ctr", "runc", "containerd-shim-runc-v2")
BUSYBOX_APPLETS = ("sh", "sleep", "cat", "echo", "true", "false", "ls", "grep", "kill", "ps", "head", "env")

IMAGE = "localhost/cri-resmgr-test/busybox:1"
PAUSE_IMAGE = "localhost/cri-resmgr-test/pause:1"
# The pause container only has to block; PID 1 ignores SIGTERM, and containerd kills sandboxes with SIGKILL.
PAUSE_ENTRYPOINT = ["/bin/sleep", "2147483647"]


def missing_prerequisites() -> str | None:
    """Why containerd cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to run containerd"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not BUSYBOX.exists():
        missing.append(str(BUSYBOX))
    if missing:
        return f"missing {', '.join(missing)} (apt-get install containerd runc busybox-static)"
    return None


# -- images -------------------------------------------------------------------------------------------


def _goarch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def busybox_layer() -> bytes:
    """An uncompressed layer tar: /bin/busybox plus applet symlinks and the directories runc needs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode = tarfile.DIRTYPE, mode
            tar.addfile(ti)

        for d in ("bin", "dev", "etc", "proc", "sys", "run", "var"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        data = BUSYBOX.read_bytes()
        ti = tarfile.TarInfo("bin/busybox")
        ti.size, ti.mode = len(data), 0o755
        tar.addfile(ti, io.BytesIO(data))
        for applet in BUSYBOX_APPLETS:
            ti = tarfile.TarInfo(f"bin/{applet}")
            ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(ti)
        for name, text in (("etc/passwd", "root:x:0:0:root:/:/bin/sh\n"), ("etc/group", "root:x:0:\n")):
            raw = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(raw), 0o644
            tar.addfile(ti, io.BytesIO(raw))
    return buf.getvalue()


def write_image_archive(path: Path, images: dict[str, dict]) -> Path:
    """Write a docker-archive tar holding ``images`` (tag -> image config ``config`` section), one shared layer."""
    layer = busybox_layer()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    manifest = []
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tar.addfile(ti, io.BytesIO(data))

        layer_name = f"{diff_id[7:]}/layer.tar"
        add(layer_name, layer)
        for tag, cfg in images.items():
            image_config = {
                "architecture": _goarch(),
                "os": "linux",
                "config": {"Env": ["PATH=/bin"], "WorkingDir": "/", **cfg},
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                "history": [{"created_by": "cri-resmgr tests: busybox-static"}],
            }
            raw = json.dumps(image_config, sort_keys=True).encode()
            name = hashlib.sha256(raw).hexdigest() + ".json"
            add(name, raw)
            manifest.append({"Config": name, "RepoTags": [tag], "Layers": [layer_name]})
        add("manifest.json", json.dumps(manifest).encode())
    return path


# -- config -------------------------------------------------------------------------------------------


def _set(text: str, section: str, key: str, value: str) -> str:
    """Replace ``key = ...`` inside TOML ``[section]`` (not its subsections); the key must be there."""
    header = f"[{section}]"
    start = text.find(header + "\n")
    if start < 0:
        raise ValueError(f"containerd config default has no section {header}")
    body_start = start + len(header) + 1
    nxt = re.compile(r"^\s*\[", re.M).search(text, body_start)
    body_end = nxt.start() if nxt else len(text)
    body = text[body_start:body_end]
    pat = re.compile(rf"^(\s*){re.escape(key)} = .*$", re.M)
    if not pat.search(body):
        raise ValueError(f"containerd config default has no {key} in {header}")
    body = pat.sub(lambda m: f"{m.group(1)}{key} = {value}", body, count=1)
    return text[:body_start] + body + text[body_end:]


def nri_config(text: str, base: Path, socket_path: Path) -> str:
    """Enable containerd 1.7's NRI with a private socket and plugin directories, and the timeouts the
    tests rely on (containerd/containerd docs/NRI.md: plugin_registration_timeout, plugin_request_timeout)."""
    q = json.dumps
    sec = 'plugins."io.containerd.nri.v1.nri"'
    t = _set(text, sec, "disable", "false")
    t = _set(t, sec, "socket_path", q(str(socket_path)))
    t = _set(t, sec, "plugin_path", q(str(base / "nri-plugins")))
    t = _set(t, sec, "plugin_config_path", q(str(base / "nri-conf.d")))
    t = _set(t, sec, "plugin_registration_timeout", q("5s"))
    return _set(t, sec, "plugin_request_timeout", q("2s"))


def private_config(default_text: str, base: Path, sandbox_image: str, runc_binary: Path | None = None) -> str:
    """``runc_binary``: the runc runtime's ``BinaryName`` (the program the runc shim runs as runc), e.g. a
    wrapper that hangs one marked operation (tests/integration/relay/runc_hang.py)."""
    q = json.dumps  # TOML basic strings share JSON's quoting for these paths
    t = default_text
    t = re.sub(r'^root = .*$', f"root = {q(str(base / 'root'))}", t, count=1, flags=re.M)
    t = re.sub(r'^state = .*$', f"state = {q(str(base / 'state'))}", t, count=1, flags=re.M)
    t = _set(t, "grpc", "address", q(str(base / "containerd.sock")))
    t = _set(t, "ttrpc", "address", q(""))
    t = _set(t, "debug", "address", q(""))
    t = _set(t, "metrics", "address", q(""))
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    t = _set(t, cri, "restrict_oom_score_adj", "true")
    t = _set(t, cri, "sandbox_image", q(sandbox_image))
    t = _set(t, cri, "stream_server_address", q("127.0.0.1"))
    t = _set(t, cri, "stream_server_port", q("0"))
    t = _set(t, f"{cri}.cni", "conf_dir", q(str(base / "cni")))
    t = _set(t, f"{cri}.cni", "bin_dir", q(str(base / "cni-bin")))
    t = _set(t, f'{cri}.containerd.runtimes.runc.options', "SystemdCgroup", "false")
    if runc_binary is not None:
        t = _set(t, f'{cri}.containerd.runtimes.runc.options', "BinaryName", q(str(runc_binary)))
    t = _set(t, 'plugins."io.containerd.internal.v1.opt"', "path", q(str(base / "opt")))
    # Snapshotters that cannot work here only add start-up noise.
    t = re.sub(r"^disabled_plugins = .*$",
               'disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", '
               '"io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", '
               '"io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]',
               t, count=1, flags=re.M)
    for want in (str(base / "root"), str(base / "state"), "restrict_oom_score_adj = true"):
        if want not in t:
            raise ValueError(f"could not set {want!r} in containerd's default config")
    return t


# -- the daemon ---------------------------------------------------------------------------------------


@dataclass
class CgroupMount:
    path: Path
    version: int


def cgroup_mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[CgroupMount]:
    """cgroup v1 and v2 mount points (proc(5), /proc/pid/mountinfo: field 5 is the mount point,
    the filesystem type follows the ``-`` separator)."""
    out = []
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split(" ", 1)[0]
        if fstype in ("cgroup", "cgroup2"):
            out.append(CgroupMount(Path(left.split()[4]), 2 if fstype == "cgroup2" else 1))
    return out


class Containerd:
    """One private containerd. ``start()`` it, ``import_images()``, talk CRI on ``socket``, ``cleanup()``."""

    def __init__(self, base: Path, bin_dir: Path | None = None, nri_socket: Path | None = None,
                 runc_binary: Path | None = None):
        """``bin_dir``: containerd's binaries (and shim) from there instead of PATH (e.g. an unpacked 1.7);
        ``nri_socket``: enable NRI, serving plugins on that socket; ``runc_binary``: what the runc shim runs
        as runc (its ``BinaryName``)."""
        self.base = Path(base)
        self.runc_binary = Path(runc_binary) if runc_binary else None
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.nri_socket = Path(nri_socket) if nri_socket else None
        self.socket = self.base / "containerd.sock"
        self.config_path = self.base / "config.toml"
        self.log_path = self.base / "containerd.log"
        # A cgroup parent of our own: everything the tests create lives under it, and cleanup removes it.
        self.cgroup_prefix = f"crirm-test-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir and (self.bin_dir / name).exists() else name

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.bin_dir:  # its shim, not the system's, must be found first
            env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        return env

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def write_config(self) -> None:
        for d in ("root", "state", "cni", "cni-bin", "opt", "images", "logs", "nri-plugins", "nri-conf.d"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        default = subprocess.run([self._bin("containerd"), "config", "default"], check=True, capture_output=True,
                                 text=True).stdout
        text = private_config(default, self.base, PAUSE_IMAGE, self.runc_binary)
        if self.nri_socket:
            text = nri_config(text, self.base, self.nri_socket)
        self.config_path.write_text(text)

    def start(self, timeout: float = 30) -> Containerd:
        if not self.config_path.exists():
            self.write_config()
        with open(self.log_path, "ab") as log:  # the daemon keeps its own descriptor
            self.proc = subprocess.Popen([self._bin("containerd"), "--config", str(self.config_path)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self._env())
        self.wait_ready(timeout)
        return self

    def up(self) -> Containerd:
        """Started with the test images imported; on failure its log is printed and everything removed."""
        try:
            self.start()
            self.import_images()
        except Exception:
            print(self.log_tail())
            self.cleanup()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(self.socket))
                    r = self.ctr("version", check=False)
                    if r.returncode == 0 and "Server:" in r.stdout:
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"containerd not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([self._bin("ctr"), "--address", str(self.socket), "-n", "k8s.io", *args],
                           capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def import_images(self) -> list[str]:
        archive = write_image_archive(self.base / "images" / "busybox.tar", {
            IMAGE: {"Cmd": ["sh"]},
            PAUSE_IMAGE: {"Entrypoint": PAUSE_ENTRYPOINT},
        })
        self.ctr("images", "import", str(archive))
        listed = self.ctr("images", "ls", "-q").stdout.split()
        for tag in (IMAGE, PAUSE_IMAGE):
            if tag not in listed:
                raise RuntimeError(f"imported image {tag} not listed by containerd: {listed}")
        return listed

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        """Stop the daemon only; shims and containers keep running (as with a real containerd restart)."""
        stop_process(self.proc, sig, timeout)

    def restart(self) -> None:
        self.stop()
        self.start()

    def task_bundle(self, container_id: str) -> Path:
        """The OCI bundle the runc shim runs a task from (runtime v2: ``<state>/io.containerd.runtime.v2.task/
        <namespace>/<id>``)."""
        return self.base / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / container_id

    def shim_pids(self) -> list[int]:
        """runc shims started by this containerd: their command line names our socket."""
        pids = []
        needle = str(self.socket).encode()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmd and needle in cmd:
                pids.append(int(p.name))
        return pids

    def cgroup_parent(self, qos: str, pod_uid: str) -> str:
        """The cgroupfs-driver parent kubelet would give a pod (pkg/kubelet/cm/cgroup_manager_linux.go)."""
        mid = "" if qos == "Guaranteed" else f"/{qos.lower()}"
        return f"/{self.cgroup_prefix}/kubepods{mid}/pod{pod_uid}"

    def cleanup(self) -> list[str]:
        """Kill containerd and our shims (their containers die with them), unmount and remove everything.
        Returns what could not be removed (empty when all is clean)."""
        self.stop(signal.SIGKILL)
        problems = []
        for pid in self.shim_pids():
            # Killing a shim's process group takes the container processes it holds with it.
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                problems.append(f"kill shim {pid}: {e}")
        # Container processes that were in their own process group: kill what is left in our cgroups.
        for m in cgroup_mounts():
            top = m.path / self.cgroup_prefix
            if not top.is_dir():
                continue
            for procs in top.rglob("cgroup.procs"):
                try:
                    for pid in procs.read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        base = str(self.base.resolve())
        for _ in range(3):
            mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
            mine = sorted({m for m in mounts if m == base or m.startswith(base + "/")}, key=len, reverse=True)
            if not mine:
                break
            for m in mine:
                subprocess.run(["umount", "-l", m], capture_output=True)
        deadline = time.time() + 10
        for m in cgroup_mounts():
            top = m.path / self.cgroup_prefix
            if not top.is_dir():
                continue
            dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for d in [*dirs, top]:
                while True:
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError as e:
                        if time.time() > deadline:
                            problems.append(f"rmdir {d}: {e.strerror}")
                            break
                        time.sleep(0.1)
        shutil.rmtree(self.base, ignore_errors=True)
        if self.base.exists():
            problems.append(f"could not remove {self.base}")
        return problems
