"""Prometheus remote-write 1.0 of the store's samples.

Protocol (https://prometheus.io/docs/specs/remote_write_spec/, "Remote Write Specification 1.0"): an HTTP POST
whose body is a snappy-compressed (block format, not framed) protobuf ``prometheus.WriteRequest``, with the headers
``Content-Encoding: snappy``, ``Content-Type: application/x-protobuf`` and
``X-Prometheus-Remote-Write-Version: 0.1.0``. The messages, from prometheus/prompb/{remote,types}.proto:

    message WriteRequest   { repeated TimeSeries timeseries = 1; reserved 2; repeated MetricMetadata metadata = 3; }
    message TimeSeries     { repeated Label labels = 1; repeated Sample samples = 2; }
    message Label          { string name = 1; string value = 2; }
    message Sample         { double value = 1; int64 timestamp = 2; }   // milliseconds since the epoch
    message MetricMetadata { MetricType type = 1; string metric_family_name = 2; string help = 4; string unit = 5; }

Labels are sorted by name and ``__name__`` carries the metric name. The messages are protobuf classes compiled
from ``export/prompb/remote.proto`` (the same public field numbers); tests parse the body back with classes built
independently from descriptors (tests/prompb.py), and a real Prometheus started with
``--web.enable-remote-write-receiver`` ingests it.

Delivery: every ``interval_seconds`` the rows the store gained since the last read are queued (bounded by
``queue_max`` samples; the oldest are dropped and counted). Batches of ``batch_max`` samples are sent in time
order. Connection errors, timeouts, 5xx and 429 are retried with exponential back-off (``Retry-After`` honoured,
capped at ``max_backoff_seconds``) — the spec's "retry on 5xx and 429, not on other 4xx". Other 4xx answers drop
the batch and count its samples as failed. Nothing is lost without a counter saying so.
"""

from __future__ import annotations

import base64
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import __version__
from .. import metrics as M
from ..config import RemoteWriteConfig, redact_url
from ..store import Store
from ..supervise import LoopStatus, start_supervised
from .exposition import DirectSample

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

METADATA_INTERVAL_SECONDS = 60.0  # like Prometheus' metadata_config.send_interval default


# -- the request ------------------------------------------------------------------------------------
# The protobuf library rather than a hand encoder (the one this module had is the bench's baseline): building
# and serializing a 10k-sample WriteRequest takes 9-13 ms with it against 22-28 ms by hand for 1000 series × 10
# rows, 6-10 against 16-26 ms for 100 × 100, and about the same for 10000 × 1 (34-41 against 38-41 ms, one run
# at 66 ms), protobuf 6.33 (upb), three runs on a loaded 2-core machine:
# `nice .venv/bin/python bench/remote_write_bench.py SERIES ROWS`.
def _pb():
    """The generated prompb classes, imported on first use: with protobuf and cramjam about 2 MB of RSS that an
    agent without remote_write never needs."""
    from .prompb import remote_pb2

    return remote_pb2


def metric_type(spec: M.MetricSpec) -> int:
    """MetricMetadata.MetricType of a metric (UNKNOWN for a type prompb does not name)."""
    pb = _pb()
    v = pb.MetricMetadata.MetricType.DESCRIPTOR.values_by_name.get(spec.type.upper())
    return pb.MetricMetadata.UNKNOWN if v is None else v.number


def encode_labels(labels: Iterable[tuple[str, str]]) -> bytes:
    """A TimeSeries holding only ``labels`` (already sorted by name), serialized: cached per series and merged
    into each request's TimeSeries (twice as fast as copying cached Label messages for one-sample series)."""
    pb = _pb()
    return pb.TimeSeries(labels=[pb.Label(name=k, value=v) for k, v in labels]).SerializeToString()


def write_request(series: Iterable[tuple[bytes, list[tuple[float, int]]]],
                  metadata: Iterable[M.MetricSpec] = ()) -> bytes:
    """A serialized WriteRequest from (:func:`encode_labels`, [(value, timestamp_ms), ...]) pairs."""
    req = _pb().WriteRequest()
    for labels, samples in series:
        ts = req.timeseries.add()
        ts.MergeFromString(labels)
        add = ts.samples.add
        for v, t in samples:
            add(value=v, timestamp=t)
    for spec in metadata:
        req.metadata.add(type=metric_type(spec), metric_family_name=spec.name, help=spec.help, unit=spec.unit or "")
    return req.SerializeToString()


def snappy_block(data: bytes) -> bytes:
    """Snappy block format (the spec requires it, not the framed format)."""
    import cramjam  # on first use, like _pb()

    return bytes(cramjam.snappy.compress_raw(data))


# -- reading the store ----------------------------------------------------------------------------
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(slots=True)
class QueuedSample:
    key: SeriesKey
    value: float
    timestamp_ms: int


class StoreCursor:
    """Remembers, per table, how many rows were read (``Table.seq`` counts rows ever written), so each row is
    queued once. Starts at the store's current end: history restored from a checkpoint is not re-sent."""

    def __init__(self, store: Store):
        self.store = store
        self.seq = store.row_counts()

    def read(self) -> tuple[list[QueuedSample], int]:
        """New samples, oldest row first, and the number of samples lost to the ring before they were read."""
        out: list[QueuedSample] = []
        lost = 0
        for new in self.store.rows_since(self.seq):
            keys = new.keys
            # upper bound: the overwritten rows' non-empty columns are unknown
            lost += (new.first - new.start) * len(keys)
            for ts_ms, vals in zip(np.rint(new.ts * 1000).astype(np.int64).tolist(), new.values.tolist(), strict=True):
                for col, v in enumerate(vals):
                    if v != v:  # NaN: series not written in this row
                        continue
                    k = keys[col]
                    if k is not None:
                        out.append(QueuedSample(k, v, ts_ms))
            self.seq[new.table] = new.end
        # No global sort: a series lives in one table, whose rows are read oldest first, and the protocol
        # only needs each series' samples in time order.
        return out, lost


# -- the writer -----------------------------------------------------------------------------------
class RetryableError(Exception):
    def __init__(self, msg: str, retry_after: float | None = None):
        super().__init__(msg)
        self.retry_after = retry_after


def _basic(user: str, password: str) -> str:
    """The credentials of a basic Authorization header, as a receiver echoing it would show them."""
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def _scrub(text: str, cfg: RemoteWriteConfig, secrets: Iterable[str]) -> str:
    """``text`` (an error from the transport or the receiver) without the URL's user information or any
    secret sent with the request."""
    text = text.replace(cfg.url, redact_url(cfg.url))
    for s in secrets:
        if len(s) >= 4:
            text = text.replace(s, "<redacted>")
    return text


class RemoteWriter:
    """Owns one thread. ``get_config`` is read every cycle, so a reload can enable, change or disable it."""

    def __init__(self, get_config: Callable[[], RemoteWriteConfig | None], store: Store,
                 direct: Callable[[], Iterable[DirectSample]] = lambda: (), node_name: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.get_config = get_config
        self.store = store
        self.direct = direct
        self.node_name = node_name
        self.clock = clock
        self.cursor = StoreCursor(store)
        self.queue: deque[QueuedSample] = deque()
        self.inflight: list[QueuedSample] | None = None
        self.sent_total = 0
        self.failed_total = 0
        self.dropped_total = 0
        self.retries_total = 0
        self.last_success: float | None = None
        self.last_error: str | None = None
        self._backoff: float | None = None
        self._labels_cache: dict[SeriesKey, bytes] = {}
        self._metadata_due = 0.0
        self._client: httpx.Client | None = None
        self._client_cfg: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.loop_status = LoopStatus("remote_write")

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        # Supervised: an error anywhere in a cycle (encoding, the send path) restarts the loop after a back-off,
        # counted in loop_status; the queue and the cursor survive the restart.
        self._thread = start_supervised(self.loop_status, self._loop, self._stop)

    def stop(self, flush_timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=flush_timeout + 15)
        if self._client:
            self._client.close()

    # -- state -------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self.queue) + (len(self.inflight) if self.inflight else 0)

    def self_metrics(self) -> list[DirectSample]:
        out = [
            DirectSample(M.REMOTE_WRITE_SENT, {}, float(self.sent_total)),
            DirectSample(M.REMOTE_WRITE_FAILED, {}, float(self.failed_total)),
            DirectSample(M.REMOTE_WRITE_DROPPED, {}, float(self.dropped_total)),
            DirectSample(M.REMOTE_WRITE_RETRIES, {}, float(self.retries_total)),
            DirectSample(M.REMOTE_WRITE_PENDING, {}, float(self.pending)),
        ]
        if self.last_success is not None:
            out.append(DirectSample(M.REMOTE_WRITE_LAST_SUCCESS, {}, self.last_success))
        return out

    # -- one cycle's steps (public so tests can drive them without the thread) --------------------------
    def enqueue(self, samples: list[QueuedSample], cfg: RemoteWriteConfig) -> None:
        with self._lock:
            q = self.queue
            room = cfg.queue_max - len(q)
            over = len(samples) - room
            if over > 0:
                # Drop the oldest: first what is queued, then the oldest of the new samples.
                from_queue = min(over, len(q))
                for _ in range(from_queue):
                    q.popleft()
                skip = over - from_queue
                self.dropped_total += over
                samples = samples[skip:]
            q.extend(samples)

    def collect(self, cfg: RemoteWriteConfig) -> None:
        """Queue the store's new rows (and, when configured, the agent's self-metrics at this instant)."""
        samples, lost = self.cursor.read()
        self.dropped_total += lost
        now_ms = int(round(self.clock() * 1000))
        if cfg.self_metrics:
            for d in self.direct():
                samples.append(QueuedSample((d.spec.name, tuple(sorted((k, str(v)) for k, v in d.labels.items()))),
                                            float(d.value), now_ms))
        if cfg.metric_regex not in (".+", ".*"):
            rx = re.compile(cfg.metric_regex)
            samples = [s for s in samples if rx.fullmatch(s.key[0])]
        self.enqueue(samples, cfg)

    def _series_labels(self, key: SeriesKey, extra: tuple[tuple[str, str], ...]) -> bytes:
        b = self._labels_cache.get(key)
        if b is None:
            if len(self._labels_cache) > 200_000:
                self._labels_cache.clear()
            labels = dict(extra)
            labels.update(key[1])
            labels["__name__"] = key[0]
            b = self._labels_cache[key] = encode_labels(sorted(labels.items()))
        return b

    def build_request(self, batch: list[QueuedSample], cfg: RemoteWriteConfig, with_metadata: bool) -> bytes:
        extra = dict(cfg.external_labels)
        if self.node_name and "node" not in extra:
            extra["node"] = self.node_name
        extra_t = tuple(sorted(extra.items()))
        if extra_t != getattr(self, "_extra_t", None):
            self._labels_cache.clear()
            self._extra_t = extra_t
        by_series: dict[SeriesKey, list[tuple[float, int]]] = {}
        for s in batch:
            by_series.setdefault(s.key, []).append((s.value, s.timestamp_ms))
        series = [(self._series_labels(k, extra_t), v) for k, v in by_series.items()]
        metadata = []
        if with_metadata:
            names = {k[0] for k in by_series}
            metadata = [spec for n in sorted(names) if (spec := M.lookup(n)) is not None]
        return write_request(series, metadata)

    def _http(self, cfg: RemoteWriteConfig) -> httpx.Client:
        import httpx  # on first use: with rich (its CLI) it is ~15 MB of RSS an agent without remote_write never needs

        key = (cfg.timeout_seconds, str(cfg.tls_ca_file))
        if self._client is None or self._client_cfg != key:
            if self._client:
                self._client.close()
            verify = str(cfg.tls_ca_file) if cfg.tls_ca_file else True
            self._client = httpx.Client(timeout=cfg.timeout_seconds, verify=verify)
            self._client_cfg = key
        return self._client

    def post(self, body: bytes, cfg: RemoteWriteConfig) -> int:
        """One POST; returns the status for 2xx and non-retryable 4xx, raises RetryableError otherwise."""
        headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
            "User-Agent": f"cri-resmgr/{__version__}",
            **{k: v.get_secret_value() for k, v in cfg.headers.items()},
        }
        secrets = list(headers.values())[4:]
        if cfg.bearer_token_file:
            try:
                token = cfg.bearer_token_file.read_text().strip()
            except OSError as e:
                raise RetryableError(f"cannot read bearer_token_file {cfg.bearer_token_file}: {e.strerror}") from None
            headers["Authorization"] = "Bearer " + token
            secrets.append(token)
        import httpx

        # User information in the URL becomes basic authentication here, and the URL sent (which httpx logs)
        # goes without it.
        url = httpx.URL(cfg.url)
        auth: httpx.BasicAuth | None = None
        if url.userinfo:
            auth = httpx.BasicAuth(url.username, url.password)
            secrets += [url.password, _basic(url.username, url.password)]
            url = url.copy_with(userinfo=b"")
        if cfg.basic_auth is not None:
            ba = cfg.basic_auth
            try:
                pw = ba.password.get_secret_value() if ba.password is not None else \
                    Path(str(ba.password_file)).read_text().strip()
            except OSError as e:
                raise RetryableError(f"cannot read basic_auth.password_file {ba.password_file}: {e.strerror}") from None
            auth = httpx.BasicAuth(ba.username, pw)
            secrets += [pw, _basic(ba.username, pw)]
        try:
            r = self._http(cfg).post(url, content=snappy_block(body), headers=headers,
                                     auth=auth if auth is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as e:
            raise RetryableError(_scrub(f"{type(e).__name__}: {e}", cfg, secrets)) from None
        if r.status_code == 429 or r.status_code >= 500:
            ra = r.headers.get("Retry-After")
            try:
                retry_after = float(ra) if ra is not None else None
            except ValueError:
                retry_after = None  # an HTTP-date: fall back to our own back-off
            raise RetryableError(_scrub(f"HTTP {r.status_code}: {r.text[:200].strip()}", cfg, secrets), retry_after)
        if r.status_code >= 300:
            self.last_error = _scrub(f"HTTP {r.status_code}: {r.text[:300].strip()}", cfg, secrets)
        return r.status_code

    def send_one(self, cfg: RemoteWriteConfig) -> float | None:
        """Send the in-flight batch (taking one from the queue if none). Returns None when done or idle, else
        the delay before the retry."""
        with self._lock:
            if self.inflight is None:
                if not self.queue:
                    return None
                n = min(cfg.batch_max, len(self.queue))
                self.inflight = [self.queue.popleft() for _ in range(n)]
        batch = self.inflight
        now = self.clock()
        with_md = now >= self._metadata_due
        body = self.build_request(batch, cfg, with_md)
        try:
            status = self.post(body, cfg)
        except RetryableError as e:
            self.retries_total += 1
            self.last_error = str(e)
            self._backoff = cfg.min_backoff_seconds if self._backoff is None else min(
                cfg.max_backoff_seconds, self._backoff * 2)
            delay = self._backoff if e.retry_after is None else min(cfg.max_backoff_seconds, max(0.0, e.retry_after))
            if self.retries_total == 1 or self.retries_total % 20 == 0:
                log.warning("remote_write to %s failed (%s); retrying in %.1fs with %d samples pending",
                            redact_url(cfg.url), e, delay, self.pending)
            return delay * (0.8 + 0.4 * random.random())  # jitter, so a fleet of nodes does not retry in step
        self._backoff = None
        if with_md:
            self._metadata_due = now + METADATA_INTERVAL_SECONDS
        if 200 <= status < 300:
            self.sent_total += len(batch)
            self.last_success = self.clock()
            self.last_error = None
        else:
            self.failed_total += len(batch)
            log.error("remote_write to %s rejected %d samples: %s", redact_url(cfg.url), len(batch), self.last_error)
        with self._lock:
            self.inflight = None
        return 0.0

    def _loop(self) -> None:
        next_collect = 0.0
        while True:
            stopping = self._stop.is_set()
            cfg = self.get_config()
            if cfg is None:
                if stopping or self._stop.wait(1.0):
                    return
                continue
            now = time.monotonic()
            if now >= next_collect or stopping:
                try:
                    self.collect(cfg)
                except Exception as e:  # never let a bad row stop exporting
                    log.exception("remote_write: reading the store failed: %s", e)
                next_collect = now + cfg.interval_seconds
            deadline = time.monotonic() + 5.0 if stopping else None
            delay = self.send_one(cfg)
            while delay == 0.0 and (deadline is None or time.monotonic() < deadline):
                delay = self.send_one(cfg)
            if stopping:
                return  # final flush done (or given up after its deadline: pending samples are in the gauge)
            # Idle: sleep until the next read of the store. Retrying: sleep the back-off (the store keeps the
            # rows meanwhile, and the queue bound holds however long the receiver is away).
            wait = max(0.0, next_collect - time.monotonic()) if delay is None else delay
            self._stop.wait(wait)
