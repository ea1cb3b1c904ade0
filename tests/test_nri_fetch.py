"""The Debian mirror URI the NRI tests fetch containerd 1.7 from is read from the system's apt sources, in
both formats of sources.list(5); the cache is reused once complete."""

from __future__ import annotations

from tests.integration.nri.containerd17 import READY, cached, debian_uris


def test_uris_from_one_line_and_deb822_sources_security_and_other_archives_left_out(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# comment\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://ftp.example.org/debian/ "
        "bookworm main\n"
        "deb-src http://src.example.org/debian bookworm main\n"
        "deb http://security.debian.org/debian-security bookworm-security main\n")
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
        "URIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://disabled.example.org/debian\nSuites: bookworm\nEnabled: no\n")
    (tmp_path / "sources.list.d" / "other.sources").write_text(
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n")
    assert debian_uris(tmp_path) == ["http://ftp.example.org/debian", "http://deb.debian.org/debian"]


def test_no_sources_gives_no_uris(tmp_path):
    assert debian_uris(tmp_path) == []


def test_cache_counts_only_when_complete(tmp_path):
    (tmp_path / "root" / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "root" / "usr" / "bin" / "containerd").write_bytes(b"")
    assert cached(tmp_path) is None  # unpacked but not marked ready: a fetch that was interrupted
    (tmp_path / READY).write_text("1.7.24~ds1-6\n")
    hit = cached(tmp_path)
    assert hit is not None and hit.version == "1.7.24~ds1-6" and hit.bin_dir == tmp_path / "root" / "usr" / "bin"
