"""remote_write: wire format parsed back with the protobuf library, queue bound, retries with back-off, rejection.
The receiver here is a small local HTTP server that answers from a script; the real Prometheus round trip is in
tests/integration/test_remote_write_prometheus.py."""

from __future__ import annotations

import ast
import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cramjam
import pytest

from cri_resmgr import metrics as M
from cri_resmgr.config import RemoteWriteConfig
from cri_resmgr.export.exposition import DirectSample
from cri_resmgr.export.remote_write import RemoteWriter, StoreCursor, encode_labels, write_request
from cri_resmgr.store import Sample, Store

from . import prompb
from .integration.helpers import free_port


class ScriptedReceiver:
    """Answers each POST with the next (status, headers) of ``script`` (then 204), recording decoded bodies."""

    def __init__(self, script: list[tuple[int, dict]] | None = None):
        self.script = list(script or [])
        self.requests: list[dict] = []  # {"time", "headers", "body"(parsed)}
        rx = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = prompb.parse(bytes(cramjam.snappy.decompress_raw(raw)))
                rx.requests.append({"time": time.monotonic(), "headers": dict(self.headers), "body": body})
                status, headers = rx.script.pop(0) if rx.script else (204, {})
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                text = b"" if status < 300 else b"scripted failure"
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def cfg(url: str, **kw) -> RemoteWriteConfig:
    base = {"url": url, "interval_seconds": 0.1, "min_backoff_seconds": 0.05, "max_backoff_seconds": 0.4,
            "timeout_seconds": 2}
    return RemoteWriteConfig(**{**base, **kw})


def filled_store(rows: int = 3, t0: float = 1_700_000_000.0) -> Store:
    s = Store(retention_seconds=600)
    for r in range(rows):
        s.append("cpu", t0 + r, [Sample("cri_resmgr_cpu_busy_seconds_total", {"cpu": str(c)}, 10.0 * r + c)
                                 for c in range(4)], 1.0)
    return s


def drain(w: RemoteWriter, c: RemoteWriteConfig, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        d = w.send_one(c)
        if d is None:
            return
        time.sleep(d)
    raise AssertionError("writer did not drain")


def test_checked_in_messages_match_the_proto(tmp_path):
    """remote_pb2.py/.pyi are what protoc makes of remote.proto now (skips without grpcio-tools)."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) compiles the .proto files")
    from cri_resmgr.export.prompb import generate, remote_pb2

    generate.compile_protos(tmp_path)
    assert _descriptor_of(tmp_path / "remote_pb2.py") == remote_pb2.DESCRIPTOR.serialized_pb, \
        "remote_pb2.py is stale: run python -m cri_resmgr.export.prompb.generate"
    checked_in = Path(remote_pb2.__file__).with_suffix(".pyi")
    assert (tmp_path / "remote_pb2.pyi").read_text() == checked_in.read_text(), "remote_pb2.pyi is stale"


def _descriptor_of(path: Path) -> bytes:
    """The serialized file descriptor in a generated module (the rest of its text varies with protoc's version)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return node.args[0].value
    raise AssertionError(f"no serialized descriptor in {path}")


def test_write_request_parses_back_with_the_protobuf_library():
    labels = encode_labels([("__name__", "m"), ("cpu", "3"), ("näme", "wert \"x\"")])
    body = write_request([(labels, [(1.25, 1_700_000_000_123), (float("inf"), 1_700_000_001_000)])],
                         [M.CPU_BUSY, M.CPU_UTILIZATION])
    got = prompb.parse(body)
    assert got["series"] == {(("__name__", "m"), ("cpu", "3"), ("näme", 'wert "x"')):
                             [(1_700_000_000_123, 1.25), (1_700_000_001_000, float("inf"))]}
    assert got["metadata"][M.CPU_BUSY.name] == (1, M.CPU_BUSY.help, "seconds")
    assert got["metadata"][M.CPU_UTILIZATION.name] == (2, M.CPU_UTILIZATION.help, "ratio")


def test_store_rows_are_sent_once_with_sorted_labels_and_node_label():
    store = filled_store(rows=0)
    with ScriptedReceiver() as rx:
        c = cfg(rx.url, external_labels={"cluster": "lab"})
        w = RemoteWriter(lambda: c, store, lambda: [DirectSample(M.COLLECTOR_UP, {"collector": "cpu"}, 1.0)],
                         node_name="n1", clock=lambda: 1_700_000_100.0)
        t0 = 1_700_000_000.0
        for r in range(3):
            store.append("cpu", t0 + r, [Sample("cri_resmgr_cpu_busy_seconds_total", {"cpu": str(cpu)}, 10.0 * r + cpu)
                                         for cpu in range(4)], 1.0)
        w.collect(c)
        drain(w, c)
        w.collect(c)  # nothing new in the store: only the self-metric again
        drain(w, c)
    series: dict = {}
    for req in rx.requests:
        assert req["headers"]["Content-Encoding"] == "snappy"
        assert req["headers"]["Content-Type"] == "application/x-protobuf"
        assert req["headers"]["X-Prometheus-Remote-Write-Version"] == "0.1.0"
        for k, v in req["body"]["series"].items():
            assert list(k) == sorted(k)  # the spec: labels sorted by name
            series.setdefault(k, []).extend(v)
    for cpu in range(4):
        key = (("__name__", "cri_resmgr_cpu_busy_seconds_total"), ("cluster", "lab"), ("cpu", str(cpu)), ("node", "n1"))
        assert series[key] == [(int((t0 + r) * 1000), 10.0 * r + cpu) for r in range(3)]
    up = (("__name__", "cri_resmgr_collector_up"), ("cluster", "lab"), ("collector", "cpu"), ("node", "n1"))
    assert series[up] == [(1_700_000_100_000, 1.0)] * 2
    assert w.sent_total == 14 and w.failed_total == 0 and w.dropped_total == 0 and w.pending == 0
    assert "cri_resmgr_cpu_busy_seconds_total" in rx.requests[0]["body"]["metadata"]


def test_restored_history_is_not_resent():
    store = filled_store(rows=5)  # as after a checkpoint restore
    cur = StoreCursor(store)
    assert cur.read() == ([], 0)
    store.append("cpu", 1_700_000_100.0, [Sample("cri_resmgr_cpu_busy_seconds_total", {"cpu": "0"}, 99.0)], 1.0)
    samples, lost = cur.read()
    assert [(s.key[0], s.value, s.timestamp_ms) for s in samples] == [
        ("cri_resmgr_cpu_busy_seconds_total", 99.0, 1_700_000_100_000)] and lost == 0


def test_rows_overwritten_before_reading_are_counted_as_dropped():
    store = Store(retention_seconds=4)  # a ring of 5 rows at 1 s
    cur = StoreCursor(store)
    for r in range(8):
        store.append("t", 1000.0 + r, [Sample("m", {"a": "1"}, float(r)), Sample("m", {"a": "2"}, float(r))], 1.0)
    samples, lost = cur.read()
    assert sorted({s.value for s in samples}) == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert lost == 3 * 2


def test_retries_back_off_and_deliver_the_batch_once():
    store = filled_store(rows=0)
    script = [(503, {}), (503, {}), (500, {}), (429, {"Retry-After": "0.3"})]
    with ScriptedReceiver(script) as rx:
        c = cfg(rx.url, self_metrics=False)
        w = RemoteWriter(lambda: c, store)
        store.append("cpu", 1_700_000_000.0, [Sample("m", {"cpu": "0"}, 1.0)], 1.0)
        w.collect(c)
        drain(w, c)
    assert len(rx.requests) == 5 and w.retries_total == 4 and w.sent_total == 1
    assert all(r["body"] == rx.requests[0]["body"] for r in rx.requests)  # the same batch each time
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(rx.requests)]
    # back-off 0.05, 0.1, 0.2 (±20% jitter), then the receiver's Retry-After of 0.3 s
    for gap, want in zip(gaps, [0.05, 0.1, 0.2, 0.3], strict=True):
        assert want * 0.8 <= gap <= want * 1.2 + 0.15, gaps
    assert w.pending == 0 and w.last_error is None


def test_backoff_is_capped_at_max_backoff():
    with ScriptedReceiver([(503, {})] * 6) as rx:
        c = cfg(rx.url, self_metrics=False, min_backoff_seconds=0.05, max_backoff_seconds=0.1)
        store = filled_store(rows=1)
        w = RemoteWriter(lambda: c, store)
        store.append("cpu", 1_700_000_100.0, [Sample("m", {}, 1.0)], 1.0)
        w.collect(c)
        delays = [w.send_one(c) for _ in range(6)]
    assert all(d <= 0.1 * 1.2 for d in delays) and delays[-1] >= 0.1 * 0.8, delays


def test_non_retryable_rejection_counts_failed_and_goes_on():
    store = filled_store(rows=0)
    with ScriptedReceiver([(400, {})]) as rx:
        c = cfg(rx.url, self_metrics=False, batch_max=4)
        w = RemoteWriter(lambda: c, store)
        store.append("cpu", 1_700_000_000.0, [Sample("m", {"cpu": str(i)}, 1.0) for i in range(6)], 1.0)
        w.collect(c)
        drain(w, c)
    assert len(rx.requests) == 2 and w.retries_total == 0
    assert w.failed_total == 4 and w.sent_total == 2 and "HTTP 400" in (w.last_error or "HTTP 400")


def test_queue_is_bounded_and_drops_the_oldest_while_the_receiver_is_down():
    port = free_port()  # nothing listens here: connection refused
    c = cfg(f"http://127.0.0.1:{port}/api/v1/write", self_metrics=False, queue_max=100, batch_max=30)
    store = Store(retention_seconds=600)
    w = RemoteWriter(lambda: c, store)
    for r in range(5):
        store.append("t", 1_700_000_000.0 + r, [Sample("m", {"i": str(i)}, float(r)) for i in range(50)], 1.0)
        w.collect(c)
        assert w.send_one(c) > 0  # refused: a retry delay
    assert w.retries_total == 5
    assert w.pending == 100 + 30  # the bounded queue plus the batch in flight
    assert w.dropped_total == 250 - 130
    assert "ConnectError" in w.last_error
    # The receiver comes back (on the same port): everything pending is delivered, in order.
    rx = ScriptedReceiver()
    rx.server.server_close()
    from http.server import ThreadingHTTPServer as T

    rx.server = T(("127.0.0.1", port), rx.server.RequestHandlerClass)
    rx.thread = threading.Thread(target=rx.server.serve_forever, daemon=True)
    with rx:
        drain(w, c)
    assert w.sent_total == 130 and w.pending == 0
    values = [v for req in rx.requests for s in req["body"]["series"].values() for _, v in s]
    # The batch in flight (the first 30 samples of row 0) is kept and retried; of the queue the newest 100 survive.
    assert sorted(values) == [0.0] * 30 + [3.0] * 50 + [4.0] * 50


def test_metric_regex_selects_what_is_sent():
    store = filled_store(rows=0)
    with ScriptedReceiver() as rx:
        c = cfg(rx.url, self_metrics=False, metric_regex="cri_resmgr_cpu_.*")
        w = RemoteWriter(lambda: c, store)
        store.append("t", 1_700_000_000.0, [Sample("cri_resmgr_cpu_busy_seconds_total", {}, 1.0),
                                            Sample("cri_resmgr_container_memory_usage_bytes", {}, 2.0)], 1.0)
        w.collect(c)
        drain(w, c)
    names = {dict(k)["__name__"] for req in rx.requests for k in req["body"]["series"]}
    assert names == {"cri_resmgr_cpu_busy_seconds_total"}


def test_writer_thread_sends_and_reports_self_metrics():
    store = filled_store(rows=0)
    with ScriptedReceiver() as rx:
        c = cfg(rx.url, self_metrics=False)
        w = RemoteWriter(lambda: c, store)
        w.start()
        try:
            store.append("t", time.time(), [Sample("m", {}, 1.0)], 1.0)
            deadline = time.time() + 10
            while w.sent_total < 1 and time.time() < deadline:
                time.sleep(0.05)
        finally:
            w.stop()
    got = {d.spec.name: d.value for d in w.self_metrics()}
    assert got[M.REMOTE_WRITE_SENT.name] == 1.0 and got[M.REMOTE_WRITE_DROPPED.name] == 0.0
    assert got[M.REMOTE_WRITE_PENDING.name] == 0.0 and M.REMOTE_WRITE_LAST_SUCCESS.name in got


@pytest.mark.parametrize("kw,needle", [
    ({"url": "prometheus:9090"}, "http:// or https://"),
    ({"url": "http://x", "metric_regex": "("}, "not a regular expression"),
    ({"url": "http://x", "queue_max": 0}, "greater than or equal to 1"),
])
def test_bad_remote_write_config_names_the_problem(kw, needle):
    from cri_resmgr.config import ConfigError, build_config

    with pytest.raises(ConfigError) as e:
        build_config({"export": {"remote_write": kw}}, env={})
    assert needle in str(e.value) and "export.remote_write." in str(e.value)
