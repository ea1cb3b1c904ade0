"""Secrets, tokens and exposure (issue 12): secrets typed as secrets and redacted in the API, logs and errors;
RFC 6750 bearer parsing; a read token; the Host check; a non-loopback listen only by decision."""

from __future__ import annotations

import base64
import logging
import os
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cri_resmgr.config import ConfigError, RemoteWriteConfig, build_config, redact_url
from cri_resmgr.export.remote_write import RemoteWriter, RetryableError
from cri_resmgr.store import Store
from cri_resmgr.web.app import create_app
from cri_resmgr.web.guard import host_allowed, needs_no_token, parse_bearer

from .test_hostile_api import make_agent

TOKEN = "s3cret-token"
READ = "read-token-123"


@pytest.mark.parametrize("header,want", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER abc", "abc"), ("Bearer   abc", "abc"),
    ("Bearer a.b-c_d~e+f/g==", "a.b-c_d~e+f/g=="),
    ("abc", None), ("", None), (None, None), ("Basic abc", None), ("Bearer", None), ("Bearer ", None),
    ("Bearer a b", None), ("Bearer a=b", None), ("Bearerabc", None),
])
def test_bearer_is_parsed_per_rfc6750(header, want):
    assert parse_bearer(header) == want


def test_mutating_endpoint_accepts_lowercase_scheme_and_rejects_bare_token(tmp_path):
    a = make_agent(tmp_path)
    try:
        c = TestClient(create_app(a))
        assert c.post("/api/v1/config/reload", headers={"Authorization": TOKEN}).status_code == 401
        r = c.post("/api/v1/config/reload", headers={"Authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200, r.text
    finally:
        a.stop()


def test_read_token_guards_everything_but_probes(tmp_path):
    a = make_agent(tmp_path, api={"token": TOKEN, "read_token": READ})
    try:
        c = TestClient(create_app(a))
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code in (200, 503)
        for path in ("/metrics", "/api/v1/topology", "/api/v1/config", "/openapi.json"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert "Authorization" in r.json()["detail"]
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": f"Bearer {READ}"}).status_code == 200, path
            assert c.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        # The read token does not mutate.
        r = c.post("/api/v1/config/reload", headers={"Authorization": f"Bearer {READ}"})
        assert r.status_code == 401
    finally:
        a.stop()


def test_ui_files_load_without_the_read_token_but_never_reach_the_api(tmp_path):
    """The page's own static files carry no node data: they load without a token so the page can ask for one.
    Nothing under /ui/ leads to the API, however the path is spelled."""
    a = make_agent(tmp_path, api={"read_token": READ})
    try:
        c = TestClient(create_app(a))
        assert c.get("/", follow_redirects=False).status_code in (302, 307)
        assert c.get("/ui/").status_code == 200 and c.get("/ui/app.js").status_code == 200
        for path in ("/ui/../api/v1/config", "/ui/%2e%2e/api/v1/config", "/ui/..%2fapi/v1/config",
                     "/ui//api/v1/config", "/uix/api/v1/config", "/ui/../metrics"):
            r = c.get(path)
            assert r.status_code in (401, 404), (path, r.status_code)
            assert "node_name" not in r.text and "cri_resmgr_" not in r.text, path
    finally:
        a.stop()
    # The decision on the raw (decoded, unnormalised) ASGI path, which a client library would normalise first.
    assert needs_no_token("/ui/app.js") and needs_no_token("/ui/") and needs_no_token("/ui")
    for raw in ("/ui/../api/v1/config", "/ui/a/../../metrics", "/ui/..", "/uix/app.js", "/api/v1/ui/"):
        assert not needs_no_token(raw), raw


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:8891", True), ("localhost:8891", True), ("[::1]:8891", True), ("LOCALHOST", True),
    ("evil.example:8891", False), ("127.0.0.1.evil.example", False), (None, False), ("", False),
])
def test_host_check_on_loopback(host, ok):
    assert host_allowed(host, "127.0.0.1", []) is ok
    assert host_allowed(host, "0.0.0.0", []) is True  # not loopback: the token is the guard


def test_dns_rebinding_host_is_refused_when_served(tmp_path):
    a = make_agent(tmp_path, api={"token": TOKEN, "allowed_hosts": ["agent.local"]})
    try:
        app = create_app(a, check_host=True)
        evil = TestClient(app, base_url="http://rebind.example:8891")
        r = evil.get("/api/v1/config")
        assert r.status_code == 421 and r.json()["detail"].startswith("Host:")
        assert TestClient(app, base_url="http://127.0.0.1:8891").get("/api/v1/config").status_code == 200
        assert TestClient(app, base_url="http://agent.local").get("/healthz").status_code == 200
    finally:
        a.stop()


def test_config_api_redacts_every_secret(tmp_path):
    rw = {"url": "http://writer:pa55word@receiver.example:9090/api/v1/write",
          "headers": {"Authorization": "Bearer hdr-secret-1", "X-Scope-OrgID": "tenant-secret-2"},
          "basic_auth": {"username": "u", "password": "basic-secret-3"}}
    a = make_agent(tmp_path, api={"token": TOKEN, "read_token": READ}, export={"remote_write": rw})
    try:
        c = TestClient(create_app(a))
        text = c.get("/api/v1/config", headers={"Authorization": f"Bearer {READ}"}).text
        for secret in (TOKEN, READ, "pa55word", "hdr-secret-1", "tenant-secret-2", "basic-secret-3"):
            assert secret not in text, secret
        active = c.get("/api/v1/config", headers={"Authorization": f"Bearer {READ}"}).json()["active"]
        assert active["export"]["remote_write"]["url"] == "http://<redacted>@receiver.example:9090/api/v1/write"
    finally:
        a.stop()


def test_wrong_typed_token_is_not_echoed(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config({"api": {"token": 987654321}}, env={})
    assert "api.token" in str(e.value) and "987654321" not in e.value.render()
    with pytest.raises(ConfigError) as e:
        build_config({"export": {"remote_write": {"url": "ftp://user:pw-secret@h/w"}}}, env={})
    assert "pw-secret" not in e.value.render() and "remote_write.url" in e.value.render()


def test_rejected_reload_is_409_and_does_not_echo_secrets(tmp_path):
    a = make_agent(tmp_path)
    try:
        c = TestClient(create_app(a))
        Path(a.config_path).write_text("api: {token: 987654321}\n")
        r = c.post("/api/v1/config/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409 and "api.token" in r.json()["detail"]
        assert "987654321" not in r.text and "987654321" not in c.get("/api/v1/config").text
        assert a.cfg.api.token.get_secret_value() == TOKEN  # the running config stays
    finally:
        a.stop()


def test_reloads_are_serialised(tmp_path):
    a = make_agent(tmp_path)
    try:
        inside, overlap = [0], [False]
        real = a._reload

        def counting():
            inside[0] += 1
            overlap[0] |= inside[0] > 1
            try:
                return real()
            finally:
                inside[0] -= 1

        a._reload = counting
        ts = [threading.Thread(target=a.reload) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not overlap[0] and a.config_state.reloads_total == 8
    finally:
        a.stop()


class _Echo(BaseHTTPRequestHandler):
    """A receiver that answers 400 and echoes the request's headers back, as a careless one might."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = str(dict(self.headers)).encode()
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_remote_write_errors_and_logs_carry_no_secret(tmp_path, caplog):
    srv = HTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        (tmp_path / "pw").write_text("file-secret-4\n")
        cfg = RemoteWriteConfig(url=f"http://w:url-secret-5@127.0.0.1:{port}/write",
                                headers={"X-Token": "hdr-secret-6"},
                                basic_auth={"username": "u", "password_file": str(tmp_path / "pw")})
        w = RemoteWriter(lambda: cfg, Store())
        with caplog.at_level(logging.DEBUG):
            assert w.post(b"", cfg) == 400  # last_error: the receiver's echo of our headers, scrubbed
            assert "<redacted>" in (w.last_error or "")
            dead = cfg.model_copy(update={"url": "http://w:url-secret-5@127.0.0.1:1/write"})
            with pytest.raises(RetryableError) as e:
                w.post(b"", dead)
        texts = [w.last_error or "", str(e.value), caplog.text, repr(cfg)]
        assert "hdr-secret-6" not in texts[0] and "file-secret-4" not in texts[0] and "url-secret-5" not in texts[0]
        b64 = [base64.b64encode(s.encode()).decode() for s in ("u:file-secret-4", "w:url-secret-5")]
        for t in texts:
            for s in ("url-secret-5", "hdr-secret-6", "file-secret-4", *b64):
                assert s not in t, (s, t)
        assert redact_url(cfg.url) == f"http://<redacted>@127.0.0.1:{port}/write"
    finally:
        srv.shutdown()


def test_non_loopback_listen_without_read_token_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"listen: 0.0.0.0:0\nstate_dir: {tmp_path}/s\nrun_dir: {tmp_path}/r\n")
    r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "run", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "CRI_RESMGR_API__TOKEN": ""})
    assert r.returncode == 2, r.stderr
    assert "api.read_token" in r.stderr and "allow_unauthenticated_reads" in r.stderr
    # A decision in the config, or a read token, lets it through validation.
    build_config({"listen": "0.0.0.0:1", "api": {"allow_unauthenticated_reads": True}}, env={})
    build_config({"listen": "[::]:1"}, env={"CRI_RESMGR_API__READ_TOKEN": "x" * 16})
    build_config({"listen": "[::1]:1"}, env={})
    with pytest.raises(ConfigError, match="api.read_token"):
        build_config({"listen": "10.0.0.5:1"}, env={})


def test_relay_dump_file_is_0600_even_with_a_lax_umask(tmp_path):
    from cri_resmgr.relay.dump import Dumper

    old = os.umask(0)
    try:
        d = Dumper(tmp_path / "dump.jsonl")
        d.f.close()
        pre = tmp_path / "old.jsonl"
        pre.write_text("")
        pre.chmod(0o666)
        Dumper(pre).f.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "dump.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE(pre.stat().st_mode) == 0o600
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        Dumper(tmp_path / "link")


def test_the_environment_cannot_turn_on_fastapis_telemetry_export(tmp_path, monkeypatch, caplog):
    """FastAPI (0.150 on) traces requests and records validation failures with their input through OpenTelemetry,
    and exports them to an OTLP endpoint when the environment says ``FASTAPI_OTEL_AUTO_CONFIGURE=true`` (set
    node-wide for other services, or by a pod template) and an OpenTelemetry SDK is installed. The agent's API
    carries tokens and what hostile clients send: none of it leaves the node that way. The agent's app turns
    FastAPI's telemetry off, so such an environment changes nothing (here, without the SDK, FastAPI would try at
    start-up and log a warning)."""
    monkeypatch.setenv("FASTAPI_OTEL_AUTO_CONFIGURE", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    a = make_agent(tmp_path)
    try:
        app = create_app(a)
        if not hasattr(app, "_telemetry"):
            pytest.skip("this FastAPI has no OpenTelemetry of its own (before 0.150): nothing to turn off")
        with caplog.at_level(logging.DEBUG), TestClient(app) as c:  # the lifespan runs: telemetry starts there
            assert c.get("/healthz").status_code == 200
        assert app._telemetry["auto_configure"] is False
        assert not any(app._telemetry[k] for k in ("tracing", "metrics", "logs", "operation_spans"))
        assert not [r for r in caplog.records if "telemetry" in r.getMessage().lower()]
    finally:
        a.stop()
