"""The agent starts whatever its checkpoint holds (issue 12): every unreadable or wrong-shaped checkpoint is
moved aside and reported, the store stays usable. Proven on a real checkpoint mangled ≥ 200 ways (restored in
process), and by starting the agent on the review's reproduction (valid npz, ``meta = []``)."""

from __future__ import annotations

import io
import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cri_resmgr.store import Sample, Store, checkpoint, parse_matchers, query_range

from .test_hostile_api import make_agent

T0 = 1_700_000_000.0


def real_checkpoint(tmp: Path) -> bytes:
    """A format-2 checkpoint of two tables: sealed blocks (XOR and scaled columns), hot rows, a reused column."""
    s = Store(retention_seconds=600)
    for i in range(300):
        t = T0 + i
        s.append("cpu", t, [Sample("m_total", {"cpu": str(c)}, i * (c + 1) * 0.01) for c in range(6)], 1.0)
        if i % 2 == 0:
            s.append("cg", t, [Sample("g", {"container_id": f"c{i // 100}"}, float(i)),
                               Sample("g", {"container_id": "x"}, 1.5 * i)], 2.0)
    d = tmp / "src"
    d.mkdir()
    checkpoint.save(s, d)
    return (d / checkpoint.FILENAME).read_bytes()


def _members(blob: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _rezip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    return out.getvalue()


def _npy(a) -> bytes:
    b = io.BytesIO()
    np.save(b, np.asarray(a), allow_pickle=False)
    return b.getvalue()


def _with_meta(blob: bytes, meta) -> bytes:
    m = _members(blob)
    m["meta.npy"] = _npy(np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return _rezip(m)


def _meta(blob: bytes) -> dict:
    return json.loads(np.load(io.BytesIO(_members(blob)["meta.npy"])).tobytes().decode())


def mangled(blob: bytes) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(12)
    cases: list[tuple[str, bytes]] = [("empty", b""), ("text", b"not a checkpoint\n"), ("zeros", bytes(4096))]
    for k in np.unique(np.linspace(1, len(blob) - 1, 70).astype(int)):  # torn writes
        cases.append((f"truncated at {k}", blob[:k]))
    for k in rng.integers(0, len(blob), 90):  # one flipped byte anywhere (headers, directory, payload)
        b = bytearray(blob)
        b[k] ^= int(rng.integers(1, 256))
        cases.append((f"byte {k} flipped", bytes(b)))
    meta = _meta(blob)
    t0 = meta["tables"][0]
    wrong = [[], {}, None, 7, "x", {"version": 2}, {"version": 2, "tables": {}}, {"version": 2, "tables": [None]},
             {"version": 2, "tables": [[]]}, {"version": 3, "tables": []}, {"version": "2", "tables": []}]
    for key, vals in (("name", [None, 7, [], {}]), ("capacity", [None, "x", -1]), ("seq", [None, "x", -5, 10**12, 1.5]),
                      ("keys", [None, 7, [7], [[1]], [["m", [["a"]]]], [["m", 7]]]),
                      ("blocks", [None, 7, [None], [{}], [{"seq0": 0}], [{"seq0": "x", "n": 1, "ncols": 1,
                                                                        "groups": []}]])):
        for v in vals:
            wrong.append({**meta, "tables": [{**t0, key: v}, *meta["tables"][1:]]})
    if t0["blocks"]:
        b0 = t0["blocks"][0]
        for key, vals in (("n", [0, -1, 10**9, "x"]), ("ncols", [0, -1, 10**6]), ("seq0", [-1, 10**9]),
                          ("groups", [None, [[0]], [[0, 9, 0]], [[9, 1, 0]], [[0, 1, 99]], [["a", 1, 0]]])):
            for v in vals:
                blocks = [{**b0, key: v}, *t0["blocks"][1:]]
                wrong.append({**meta, "tables": [{**t0, "blocks": blocks}, *meta["tables"][1:]]})
    for i, m in enumerate(wrong):
        cases.append((f"meta variant {i}: {json.dumps(m)[:60]}", _with_meta(blob, m)))
    members = _members(blob)
    arrays = [n for n in members if n != "meta.npy"]
    replacements = [np.zeros(0), np.zeros((3, 3)), np.array(["a"]), np.zeros(5, dtype=np.int8),
                    np.full(4, np.nan), np.zeros((0, 0)), np.array([1e308])]
    for i, n in enumerate(arrays):
        m = dict(members)
        m[n] = _npy(replacements[i % len(replacements)])
        cases.append((f"array {n} replaced", _rezip(m)))
    for n in arrays[:10]:
        m = dict(members)
        del m[n]
        cases.append((f"array {n} missing", _rezip(m)))
    m = dict(members)
    m["meta.npy"] = _npy(np.array([[1, 2], [3, 4]]))
    cases.append(("meta a 2-D int array", _rezip(m)))
    m = dict(members)
    m["meta.npy"] = b"\x93NUMPY\x01\x00" + b"\xff" * 64
    cases.append(("meta a broken npy header", _rezip(m)))
    cases.append(("a zip without members", _rezip({})))
    return cases


def test_fuzzed_checkpoints_never_stop_the_start(tmp_path):
    blob = real_checkpoint(tmp_path)
    cases = mangled(blob)
    assert len(cases) >= 200, len(cases)
    restored = aside = 0
    t0 = time.monotonic()
    for i, (name, data) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        (d / checkpoint.FILENAME).write_bytes(data)
        s = Store(retention_seconds=600)
        res = checkpoint.restore(s, d, lambda t: {"cpu": 1.0, "cg": 2.0}.get(t, 1.0), now=T0 + 400)
        if res.restored:
            restored += 1
            assert res.error is None, name
        else:
            aside += 1
            assert res.error and "moved to" in res.error, name
            assert not (d / checkpoint.FILENAME).exists(), name
            assert len(list(d.glob(f"{checkpoint.FILENAME}.corrupt-*"))) == 1, name
            assert s.series_count == 0 and not s.tables, name
        # Whatever happened, the store takes writes and answers queries (the agent runs on).
        s.append("cpu", T0 + 500, [Sample("m_total", {"cpu": "0"}, 1.0)], 1.0)
        s.append("cpu", T0 + 501, [Sample("m_total", {"cpu": "0"}, 2.0)], 1.0)
        times, series = query_range(s, "m_total", parse_matchers('cpu="0"'), T0 + 490, T0 + 501, 1.0)
        assert series and series[0].values[-1] == 2.0, name
        checkpoint.save(s, d)  # and the next checkpoint replaces the bad one
        assert checkpoint.restore(Store(retention_seconds=600), d).restored, name
    assert aside >= 150 and restored >= 1, (aside, restored)
    assert time.monotonic() - t0 < 90


def test_unmangled_checkpoint_round_trips(tmp_path):
    blob = real_checkpoint(tmp_path)
    (tmp_path / checkpoint.FILENAME).write_bytes(blob)
    s = Store(retention_seconds=600)
    res = checkpoint.restore(s, tmp_path, lambda t: {"cpu": 1.0, "cg": 2.0}[t], now=T0 + 400)
    assert res.restored and res.future_rows == 0 and res.series == 10
    ts, vs = s.raw(s.select("m_total", parse_matchers('cpu="2"'))[0], 0, 1e12)
    assert len(ts) == 300 and vs[-1] == pytest.approx(299 * 3 * 0.01)


def test_rows_from_the_future_are_dropped_at_restore_and_reported(tmp_path):
    # The checkpoint was written, then the wall clock was set back 200 s before the agent restarted.
    blob = real_checkpoint(tmp_path)
    (tmp_path / checkpoint.FILENAME).write_bytes(blob)
    s = Store(retention_seconds=600)
    now = T0 + 299 - 200
    res = checkpoint.restore(s, tmp_path, lambda t: {"cpu": 1.0, "cg": 2.0}[t], now=now, future_tolerance_seconds=0)
    assert res.restored and res.future_rows == 200 + 100 and "future" in (res.note or "")
    for name in ("cpu", "cg"):
        assert s.tables[name].last_time() <= now
    ref = s.select("m_total", parse_matchers('cpu="1"'))[0]
    ts, vs = s.raw(ref, 0, 1e12)
    assert ts[-1] == now and len(ts) == 100 and vs[-1] == pytest.approx(99 * 2 * 0.01)
    # The next sample (in the stepped-back present) is stored, and the latest value is the new one.
    s.append("cpu", now + 1, [Sample("m_total", {"cpu": "1"}, 5.0)], 1.0)
    assert s.rows_out_of_order == 0
    assert {r.label_dict["cpu"]: v for r, _, v in s.latest("m_total")}["1"] == 5.0


def test_agent_starts_on_the_reviews_checkpoint_and_reports_it(tmp_path):
    # Reproduction: valid npz of the wrong shape (meta = []) made every start exit 1.
    state = tmp_path / "state"
    state.mkdir()
    np.savez(state / checkpoint.FILENAME, meta=np.frombuffer(b"[]", dtype=np.uint8))
    a = make_agent(tmp_path)
    try:
        assert a.restore_note and "moved to" in a.restore_note
        assert not (state / checkpoint.FILENAME).exists() and list(state.glob("store.npz.corrupt-*"))
        from fastapi.testclient import TestClient

        from cri_resmgr.web.app import create_app

        st = TestClient(create_app(a)).get("/api/v1/store").json()
        assert "moved to" in st["restore_note"]
    finally:
        a.stop()


def test_checkpoint_failures_are_counted_and_the_loop_keeps_going(tmp_path):
    a = make_agent(tmp_path, store={"checkpoint_interval_seconds": 1})
    try:
        # A directory where the checkpoint goes: rename(2) fails for real (EISDIR / ENOTEMPTY).
        blocker = a.state_dir / checkpoint.FILENAME
        if blocker.exists():
            blocker.unlink()
        blocker.mkdir()
        (blocker / "x").write_text("")
        deadline = time.time() + 15
        while a.checkpoint_errors_total < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert a.checkpoint_errors_total >= 2
        assert a.loops["checkpoint"].running and "failed" in (a.loops["checkpoint"].last_error or "")
        (blocker / "x").unlink()
        blocker.rmdir()
        n = a.checkpoint_errors_total
        deadline = time.time() + 15
        while not (a.state_dir / checkpoint.FILENAME).is_file() and time.time() < deadline:
            time.sleep(0.1)
        assert (a.state_dir / checkpoint.FILENAME).is_file() and a.checkpoint_errors_total <= n + 1
        text = "".join(f"{d.spec.name}{d.labels} {d.value}\n" for d in a.self_metrics())
        assert "cri_resmgr_store_checkpoint_errors_total{}" in text
    finally:
        a.stop()
