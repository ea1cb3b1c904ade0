"""Remote-write request encoding: the agent's protobuf messages (export/remote_write.py) against the hand encoder
it used before (kept here as the baseline: a few varints and length prefixes, labels cached as bytes).

Both build the same ``WriteRequest`` from one batch of ``QueuedSample`` (SERIES series × ROWS samples, the
agent's shape: every series of a table written each row) and serialize it, each caching per-series labels.
Checks that the bodies parse to the same request (tests/prompb.py), then prints medians.

    nice .venv/bin/python bench/remote_write_bench.py [SERIES ROWS]
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from _util import median_time

from cri_resmgr.config import RemoteWriteConfig
from cri_resmgr.export.remote_write import QueuedSample, RemoteWriter
from cri_resmgr.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import prompb


# -- the baseline: protobuf wire format by hand (https://protobuf.dev/programming-guides/encoding/) -------------
def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _labels(labels) -> bytes:
    return b"".join(_len_field(1, _len_field(1, k.encode()) + _len_field(2, v.encode())) for k, v in labels)


def _sample(value: float, timestamp_ms: int) -> bytes:
    return _len_field(2, b"\x09" + struct.pack("<d", value) + b"\x10" + _varint(timestamp_ms))


def by_hand(samples: list[QueuedSample], cache: dict, extra: tuple[tuple[str, str], ...]) -> bytes:
    by_series: dict = {}
    for s in samples:
        by_series.setdefault(s.key, []).append((s.value, s.timestamp_ms))
    parts = []
    for key, ss in by_series.items():
        lab = cache.get(key)
        if lab is None:
            d = dict(extra)
            d.update(key[1])
            d["__name__"] = key[0]
            lab = cache[key] = _labels(sorted(d.items()))
        parts.append(_len_field(1, lab + b"".join(_sample(v, t) for v, t in ss)))
    return b"".join(parts)


def batch(series: int, rows: int) -> list[QueuedSample]:
    out = []
    for r in range(rows):
        for c in range(series):
            key = ("cri_resmgr_container_cpu_usage_seconds_total",
                   (("container", f"c{c}"), ("namespace", "default"), ("pod", f"pod-{c // 4}")))
            out.append(QueuedSample(key, 1234.5 + r * 0.01 + c, 1_700_000_000_000 + r * 1000))
    return out


def main() -> None:
    series, rows = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (1000, 10)
    samples = batch(series, rows)
    cfg = RemoteWriteConfig(url="http://127.0.0.1:1/api/v1/write")
    writer = RemoteWriter(lambda: cfg, Store(), node_name="n1")
    cache: dict = {}
    extra = (("node", "n1"),)
    lib = writer.build_request(samples, cfg, with_metadata=False)
    hand = by_hand(samples, cache, extra)
    assert prompb.parse(hand) == prompb.parse(lib), "the two encoders disagree"
    t_lib = median_time(lambda: writer.build_request(samples, cfg, with_metadata=False), repeat=15)
    t_hand = median_time(lambda: by_hand(samples, cache, extra), repeat=15)
    print(f"{len(samples)} samples in {series} series: protobuf (agent) {t_lib * 1e3:.1f} ms, "
          f"hand encoder {t_hand * 1e3:.1f} ms, protobuf/hand {t_lib / t_hand:.2f}; {len(lib)} bytes")


if __name__ == "__main__":
    main()
