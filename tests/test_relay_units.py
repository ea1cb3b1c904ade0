"""Pure parts of the relay: request estimation, annotations, the cache file, HTTP/2 and HPACK helpers."""

from __future__ import annotations

import json

import hpack
import pytest

from cri_resmgr.placement import model as C
from cri_resmgr.placement.annotations import effective_annotations
from cri_resmgr.placement.estimate import (
    BEST_EFFORT,
    BURSTABLE,
    GUARANTEED,
    estimate,
    milli_from_shares,
    qos_from_cgroup_parent,
)
from cri_resmgr.placement.persist import load_cache, write_whole
from cri_resmgr.relay import h2proxy as h2p
from cri_resmgr.relay.h2proxy import (
    DATA,
    F_END_STREAM,
    HEADERS,
    MAX_FRAME_PAYLOAD,
    data_frames,
    encode_never_indexed,
    grpc_message,
    trailers_only,
)
from cri_resmgr.relay.stats import BUCKETS, RelayStats


def kubelet_shares(milli: int) -> int:  # pkg/kubelet/cm/helpers_linux.go MilliCPUToShares
    return max(2, milli * 1024 // 1000)


def kubelet_quota(milli: int, period: int = 100000) -> int:  # MilliCPUToQuota
    return max(1000, milli * period // 1000)


def test_shares_give_back_the_exact_request_for_every_milli_value():
    wrong = [m for m in range(3, 200_001) if milli_from_shares(kubelet_shares(m)) != m]
    assert wrong == []
    assert milli_from_shares(2) == 0


@pytest.mark.parametrize("parent,qos", [
    ("/kubepods/burstable/pod1234", BURSTABLE),
    ("/kubepods/besteffort/pod1234", BEST_EFFORT),
    ("/kubepods/pod1234", GUARANTEED),
    ("kubepods-burstable-pod12_34.slice", BURSTABLE),
    ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12.slice", BEST_EFFORT),
    ("/kubepods.slice/kubepods-pod12.slice", GUARANTEED),
    ("/system.slice/docker.service", ""),
    ("", ""),
])
def test_qos_class_from_cgroup_parent(parent, qos):
    assert qos_from_cgroup_parent(parent) == qos


def test_estimates_for_each_qos_class():
    g = estimate(kubelet_shares(3000), kubelet_quota(3000), 100000, 1 << 30, "/kubepods/pod1")
    assert (g.qos_class, g.cpu_request_milli, g.cpu_limit_milli, g.memory_limit_bytes, g.whole_cpus) == (
        GUARANTEED, 3000, 3000, 1 << 30, 3)
    frac = estimate(kubelet_shares(1500), kubelet_quota(1500), 100000, 0, "/kubepods/pod1")
    assert (frac.cpu_request_milli, frac.whole_cpus, frac.memory_limit_bytes) == (1500, 0, None)
    tiny = estimate(kubelet_shares(2), kubelet_quota(2), 100000, 0, "/kubepods/pod1")
    assert tiny.cpu_request_milli == 10  # below 3m only the (clipped) quota speaks
    b = estimate(kubelet_shares(250), kubelet_quota(2000), 100000, 0, "/kubepods/burstable/pod1")
    assert (b.qos_class, b.cpu_request_milli, b.cpu_limit_milli, b.whole_cpus) == (BURSTABLE, 250, 2000, 0)
    b_mem_only = estimate(2, 0, 0, 256 << 20, "/kubepods/burstable/pod1")
    assert (b_mem_only.cpu_request_milli, b_mem_only.cpu_limit_milli) == (0, None)
    be = estimate(2, 0, 0, 0, "/kubepods/besteffort/pod1")
    assert (be.qos_class, be.cpu_request_milli, be.cpu_limit_milli) == (BEST_EFFORT, 0, None)
    # a whole-CPU Burstable request is not exclusive
    assert estimate(kubelet_shares(2000), 0, 0, 0, "/kubepods/burstable/pod1").whole_cpus == 0


def test_effective_annotations_pod_then_container_then_per_container_keys():
    pod = {"cri-resmgr.io/avx512": "true", "cri-resmgr.io/latency-critical": "false",
           "cri-resmgr.io/latency-critical.container.web": "true", "other.io/x": "1"}
    ctr = {"cri-resmgr.io/avx512": "false"}
    assert effective_annotations(pod, ctr, "web") == {"cri-resmgr.io/avx512": "false",
                                                      "cri-resmgr.io/latency-critical": "true"}
    assert effective_annotations(pod, {}, "db") == {"cri-resmgr.io/avx512": "true",
                                                    "cri-resmgr.io/latency-critical": "false"}


def test_cache_round_trips_and_a_broken_file_is_moved_aside(tmp_path):
    c = C.Cache()
    c.pods["p"] = C.Pod("p", "pod", "ns", "uid", "Guaranteed", "/kubepods/poduid", {"a": "b"})
    c.containers["c"] = C.Container("c", "p", "app", "ns", "pod", "uid", "Guaranteed", "/kubepods/poduid",
                                    placement=C.Kind.EXCLUSIVE, cpus="2-3", mems="0", state=C.State.RUNNING)
    path = tmp_path / "relay-cache.json"
    write_whole(path, c.to_json())
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = load_cache(path)
    assert loaded.note is None and loaded.cache == c
    assert loaded.cache.exclusive_taken() == {"c": frozenset({2, 3})}
    assert loaded.cache.containers["c"].cgroup_path == "/kubepods/poduid/c"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    path.write_text("{not json")
    broken = load_cache(path, clock_s=1000)
    assert broken.cache == C.Cache() and "unusable cache" in broken.note
    assert broken.moved_to == tmp_path / "relay-cache.json.corrupt-1000"
    assert broken.moved_to.read_text() == "{not json" and not path.exists()
    path.write_text(json.dumps({"version": 99}))
    assert "unsupported cache version 99" in load_cache(path, clock_s=1001).note


def test_own_header_blocks_decode_anywhere_and_leave_the_dynamic_table_alone():
    d = hpack.Decoder()
    enc = hpack.Encoder()
    first = d.decode(enc.encode([(":status", "200"), ("x-a", "1")]))  # the runtime's encoder fills the table
    table = list(d.header_table.dynamic_entries)
    block = encode_never_indexed([(b"grpc-status", b"14"), (b"grpc-message", b"a" * 300)])
    assert d.decode(block, raw=True) == [(b"grpc-status", b"14"), (b"grpc-message", b"a" * 300)]
    assert list(d.header_table.dynamic_entries) == table
    assert d.decode(enc.encode([(":status", "200"), ("x-a", "1")])) == first  # still in step


def test_trailers_only_and_data_framing():
    f = trailers_only(7, 8, "no CPUs: 100% used")
    assert f[3] == HEADERS and f[4] & F_END_STREAM and int.from_bytes(f[5:9], "big") == 7
    headers = dict(hpack.Decoder().decode(f[9:], raw=True))
    assert headers[b"grpc-status"] == b"8" and headers[b"grpc-message"] == b"no CPUs: 100%25 used"
    msg = bytes(range(256)) * 200  # 51200 bytes: four DATA frames
    raw, size = data_frames(5, msg)
    frames, pos, body = [], 0, b""
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 3], "big")
        frames.append((raw[pos + 3], raw[pos + 4], n))
        body += raw[pos + 9:pos + 9 + n]
        pos += 9 + n
    assert all(t == DATA and n <= MAX_FRAME_PAYLOAD for t, _f, n in frames)
    assert [f & F_END_STREAM for _t, f, _n in frames] == [0, 0, 0, F_END_STREAM]
    assert size == len(body) == len(msg) + 5 and grpc_message(body) == msg
    assert grpc_message(b"\x01" + body[1:]) is None  # compressed: not ours to read
    assert grpc_message(body[:-1]) is None


def test_stats_render_cumulative_histograms_and_bound_method_labels():
    s = RelayStats(frozenset({"/runtime.v1.RuntimeService/Version"}))
    s.record("/runtime.v1.RuntimeService/Version", "OK", 40e-6)
    s.record("/runtime.v1.RuntimeService/Version", "OK", 0.3e-3)
    s.record("/made/up", "UNIMPLEMENTED", 1.0)
    text = s.render()
    assert BUCKETS[0] == 50e-6
    assert 'cri_resmgr_relay_requests_total{method="Version",code="OK"} 2' in text
    assert 'cri_resmgr_relay_requests_total{method="other",code="UNIMPLEMENTED"} 1' in text
    assert 'cri_resmgr_relay_request_duration_seconds_bucket{method="Version",le="5e-05"} 1' in text
    assert 'cri_resmgr_relay_request_duration_seconds_bucket{method="Version",le="0.0004"} 2' in text
    assert 'cri_resmgr_relay_request_duration_seconds_bucket{method="Version",le="+Inf"} 2' in text
    assert 'cri_resmgr_relay_request_duration_seconds_count{method="Version"} 2' in text


def test_fast_header_decoding_agrees_with_the_full_decoder_over_a_session():
    from cri_resmgr.relay.h2proxy import decode_block

    enc = hpack.Encoder()
    full, fast = hpack.Decoder(), hpack.Decoder()
    blocks = []
    for i in range(300):
        hs = [(":method", "POST"), (":path", f"/runtime.v1.RuntimeService/M{i % 7}"), ("te", "trailers"),
              ("grpc-timeout", f"{i % 3}m"), ("x-id", str(i % 11))]
        blocks.append(enc.encode(hs))
    fast_hits = 0
    for b in blocks:
        if min(b) > 0x80 and max(b) < 0xFF:
            fast_hits += 1
        assert decode_block(fast, b) == full.decode(b, raw=True)
    assert fast_hits > 100  # the fast path is actually taken once the table holds the headers


def test_rewrite_timings_travel_as_json_and_come_back_as_they_were(tmp_path):
    from cri_resmgr.relay.control import ControlClient, serve
    from cri_resmgr.relay.h2proxy import RewriteTiming

    s = RelayStats(frozenset({"/runtime.v1.RuntimeService/CreateContainer"}))
    t = RewriteTiming(arrived=1.0, headers=1.5, first_data=1.6, held=2.0, started=2.0, returned=2.5,
                      forwarded=2.75, upstream_buffered=7, response=9.0, response_end=9.25, answered=9.5,
                      completed=9.75, reads=2)
    for _ in range(1005):
        s.record_rewrite("/runtime.v1.RuntimeService/CreateContainer", t)
    s.record_rewrite("/x.Invented/Path", RewriteTiming(headers=3.0))
    server = serve(None, tmp_path / "control.sock", lambda: "",  # type: ignore[arg-type]
                   timings=lambda: {"rewrites": s.rewrite_samples()})
    try:
        client = ControlClient(tmp_path / "control.sock", timeout=5)
        got = client.rewrite_timings()
        client.close()
    finally:
        server.stop(grace=0)
    assert len(got["CreateContainer"]) == 1000 and got["CreateContainer"][-1] == t  # the last 1,000 kept
    assert got["other"] == [RewriteTiming(headers=3.0)]  # invented methods share one label


class _Sink:
    """A transport that keeps every write as its own chunk."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _Counting(h2p.Hooks):
    def __init__(self) -> None:
        self.ended: list[tuple[str, int]] = []

    def finished(self, method: str, code: int, seconds: float) -> None:
        self.ended.append((method, code))


def _pair() -> tuple[h2p.Pair, _Sink, _Sink, _Counting]:
    hooks = _Counting()
    proxy = h2p.Proxy("/nonexistent", hooks, executor=None)  # type: ignore[arg-type]
    client, upstream = _Sink(), _Sink()
    pair = h2p.Pair(proxy, client)  # type: ignore[arg-type]
    pair.upstream = upstream  # type: ignore[assignment]
    return pair, client, upstream, hooks


def test_pass_through_frames_go_out_byte_for_byte_in_one_write_per_read():
    """A read carrying the preface, SETTINGS, a call (HEADERS, padded DATA), PING, WINDOW_UPDATE and RST_STREAM
    of another stream reaches the runtime exactly as it came, in one write, less the PING, which the proxy
    answers itself, once the runtime's SETTINGS went to the client (RFC 9113 §3.4: the server's preface comes
    first); so does the runtime's answer (with its SETTINGS, a PING of its own, answered by the proxy,
    the response and trailers), and the call is counted with its status."""
    enc = hpack.Encoder()
    req = enc.encode([(":method", "POST"), (":scheme", "http"), (":path", "/runtime.v1.RuntimeService/Version"),
                      (":authority", "x"), ("content-type", "application/grpc"), ("grpc-timeout", "1999876u")])
    body = b"\x00\x00\x00\x00\x02\x0a\x00"
    head = (h2p.PREFACE + h2p.frame(h2p.SETTINGS, 0, 0, b"\x00\x01\x00\x00\x10\x00")
            + h2p.frame(h2p.HEADERS, h2p.F_END_HEADERS, 1, req)
            + h2p.frame(h2p.DATA, h2p.F_END_STREAM | h2p.F_PADDED, 1, b"\x03" + body + b"\x00\x00\x00"))
    ping = h2p.frame(h2p.PING, 0, 0, b"12345678")
    tail = (h2p.frame(h2p.WINDOW_UPDATE, 0, 0, b"\x00\x00\x01\x00")
            + h2p.frame(h2p.RST_STREAM, 0, 3, b"\x00\x00\x00\x08"))
    c2s = head + ping + tail
    pair, client, upstream, hooks = _pair()
    pair.from_client(c2s[:40])  # a read may end inside a frame: the rest waits for the next one
    pair.from_client(c2s[40:])
    assert b"".join(upstream.writes) == head + tail and len(upstream.writes) == 2
    assert client.writes == []  # the runtime has not spoken yet
    enc_s = hpack.Encoder()
    resp = enc_s.encode([(":status", "200"), ("content-type", "application/grpc")])
    trailers = enc_s.encode([("grpc-status", "0")])
    answer = (h2p.frame(h2p.HEADERS, h2p.F_END_HEADERS, 1, resp) + h2p.frame(h2p.DATA, 0, 1, body)
              + h2p.frame(h2p.HEADERS, h2p.F_END_HEADERS | h2p.F_END_STREAM, 1, trailers))
    settings = h2p.frame(h2p.SETTINGS, 0, 0, b"")
    pair.from_upstream(settings + h2p.frame(h2p.PING, 0, 0, b"runtime!") + answer)
    assert client.writes == [settings + answer + h2p.frame(h2p.PING, h2p.F_ACK, 0, b"12345678")]
    assert upstream.writes[2:] == [h2p.frame(h2p.PING, h2p.F_ACK, 0, b"runtime!")]
    assert hooks.ended == [("/runtime.v1.RuntimeService/Version", 0)]
