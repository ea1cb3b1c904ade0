"""Fetch Debian 13 (trixie)'s containerd 1.7 without touching the system's apt state, for tests and bench.

The issue's recipe: a private apt configuration whose only source is ``deb [signed-by=<debian keyring>]
<the system's Debian mirror URI> trixie main`` (the URI read from /etc/apt/sources.list or
/etc/apt/sources.list.d/*, one-line or deb822 format: sources.list(5)), private lists and cache directories,
``apt-get update`` + ``apt-get download containerd``, then ``dpkg -x`` into a private directory. The result is
kept in a cache directory (``$CRI_RESMGR_CONTAINERD17_CACHE``, else /var/cache/cri-resmgr-test/containerd-1.7
when writable, else build/containerd-1.7) and reused between runs. The package's ``usr/bin`` holds containerd,
ctr and containerd-shim-runc-v2 1.7; runc is the system's (its binary works with both).

    .venv/bin/python -m tests.integration.nri.containerd17   # fetch (or show the cached copy)
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
SUITE = "trixie"
PACKAGE = "containerd"
REPO_ROOT = Path(__file__).resolve().parents[3]
READY = "READY"  # written last: a directory without it is a half-done fetch


@dataclass(frozen=True)
class Fetched:
    root: Path  # the unpacked package
    version: str

    @property
    def bin_dir(self) -> Path:
        return self.root / "usr" / "bin"


class FetchError(Exception):
    """Why containerd 1.7 cannot be had here (tests skip with it)."""


def cache_dir() -> Path:
    env = os.environ.get("CRI_RESMGR_CONTAINERD17_CACHE")
    if env:
        return Path(env)
    var = Path("/var/cache/cri-resmgr-test")
    try:
        var.mkdir(parents=True, exist_ok=True)
        if os.access(var, os.W_OK):
            return var / "containerd-1.7"
    except OSError:
        pass
    return REPO_ROOT / "build" / "containerd-1.7"


def debian_uris(etc: Path = Path("/etc/apt")) -> list[str]:
    """Debian archive URIs of the system's apt sources (not -security), in file order.

    sources.list(5): one-line entries ``deb [options] uri suite [component...]`` in sources.list and
    sources.list.d/*.list; deb822 stanzas with ``URIs:`` and ``Suites:`` fields in sources.list.d/*.sources."""
    files = [etc / "sources.list"] + sorted((etc / "sources.list.d").glob("*.list")) + \
        sorted((etc / "sources.list.d").glob("*.sources"))
    out: list[str] = []
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    k, _, v = line.partition(":")
                    fields[k.strip().lower()] = v.strip()
                if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
                    continue
                for uri in fields.get("uris", "").split():
                    out.append(uri)
        else:
            for line in text.splitlines():
                words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()  # options in [...] dropped
                if len(words) >= 3 and words[0] == "deb":
                    out.append(words[1])
    return [u.rstrip("/") for u in out if re.search(r"/debian$", u.rstrip("/"))]


def _run(args: list[str], cwd: Path | None = None) -> str:
    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise FetchError(f"{' '.join(args[:2])} ... {args[-1]} failed ({r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout


def cached(base: Path | None = None) -> Fetched | None:
    base = base or cache_dir()
    ready = base / READY
    if ready.exists() and (base / "root" / "usr" / "bin" / "containerd").exists():
        return Fetched(base / "root", ready.read_text().strip())
    return None


def fetch(base: Path | None = None) -> Fetched:
    """The unpacked package, fetched once; raises :class:`FetchError` with the reason when it cannot be."""
    base = base or cache_dir()
    hit = cached(base)
    if hit:
        return hit
    for tool in ("apt-get", "dpkg", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise FetchError(f"{tool} not found (not a Debian system?)")
    if not KEYRING.exists():
        raise FetchError(f"{KEYRING} missing (apt-get install debian-archive-keyring)")
    if os.geteuid() != 0:
        raise FetchError("fetching with apt-get needs root")
    uris = debian_uris()
    if not uris:
        raise FetchError("no Debian mirror URI in /etc/apt/sources.list or /etc/apt/sources.list.d/*")
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time; the others then find it cached
        hit = cached(base)
        if hit:
            return hit
        apt = base / "apt"
        for d in (apt / "lists" / "partial", apt / "cache" / "archives" / "partial", base / "debs"):
            d.mkdir(parents=True, exist_ok=True)
        (apt / "sources.list").write_text(f"deb [signed-by={KEYRING}] {uris[0]} {SUITE} main\n")
        opts = ["-o", f"Dir::Etc::SourceList={apt / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
                "-o", "APT::Sandbox::User=root", "-q"]
        _run(["apt-get", *opts, "update"])
        for old in (base / "debs").glob("*.deb"):
            old.unlink()
        _run(["apt-get", *opts, "download", PACKAGE], cwd=base / "debs")
        debs = sorted((base / "debs").glob(f"{PACKAGE}_*.deb"))
        if not debs:
            raise FetchError(f"apt-get download {PACKAGE} left no .deb in {base / 'debs'}")
        version = _run(["dpkg-deb", "-f", str(debs[0]), "Version"]).strip()
        tmp = base / "root.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _run(["dpkg", "-x", str(debs[0]), str(tmp)])
        shutil.rmtree(base / "root", ignore_errors=True)
        tmp.rename(base / "root")
        r = subprocess.run([str(base / "root" / "usr" / "bin" / "containerd"), "--version"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise FetchError(f"the fetched containerd does not run here: {r.stderr.strip()[-300:]}")
        (base / READY).write_text(version + "\n")
        return Fetched(base / "root", version)


def main() -> int:
    try:
        f = fetch()
    except FetchError as e:
        print(f"cannot fetch containerd 1.7: {e}", file=sys.stderr)
        return 1
    print(f"containerd {f.version} in {f.bin_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
