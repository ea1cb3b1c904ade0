"""Incremental checkpoints (store/checkpoint.py, format 3): a running Checkpointer writes each sealed block once,
into a segment, and a restore from its files holds exactly what a full checkpoint of the same store holds —
also after segments expire, after a crash (kill -9) in the middle of a checkpoint, and not when a segment is
damaged or gone (reported, moved aside, like a damaged manifest)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cri_resmgr.store import Sample, Store, checkpoint

T0 = 1_700_000_000.0
REPO = Path(__file__).resolve().parent.parent


def write_rows(s: Store, start: int, stop: int) -> None:
    """Rows ``start``..``stop`` of two tables; series come and go (columns are reclaimed and reused)."""
    for i in range(start, stop):
        cpu = [Sample("m_total", {"cpu": str(c)}, i * (c + 1) * 0.01) for c in range(4)]
        s.append("cpu", T0 + i, cpu, 1.0)
        if i % 2 == 0:
            gen = i // 300  # a new container every 300 rows; each lives 600 rows
            cg = [Sample("g", {"container_id": f"c{k}"}, float(i * (k + 1))) for k in (gen - 1, gen) if k >= 0]
            s.append("cg", T0 + i, cg + [Sample("g", {"container_id": "x"}, 1.5 * i)], 2.0)


def everything(s: Store) -> dict:
    """Every series' every kept row (time, value), and each table's position."""
    out: dict = {}
    with s.lock:
        for name, tab in s.tables.items():
            out[name] = (tab.seq, tab.floor)
            for col, key in enumerate(tab.keys):
                if key is None:
                    continue
                ts, V = tab.rows(tab.floor, tab.seq, np.array([col]))
                ok = ~np.isnan(V[:, 0])
                out[key] = (ts[ok].tolist(), V[ok, 0].tolist())
    return out


def restored(d: Path) -> Store:
    s = Store(retention_seconds=600)
    res = checkpoint.restore(s, d, lambda t: {"cpu": 1.0, "cg": 2.0}[t])
    assert res.restored and res.error is None, res
    return s


def segments(d: Path) -> set[str]:
    return {f.name for f in d.glob(f"{checkpoint.SEGMENT_PREFIX}*.npz")}


def test_incremental_checkpoints_restore_exactly_what_a_full_one_does(tmp_path):
    inc, full = tmp_path / "inc", tmp_path / "full"
    inc.mkdir()
    full.mkdir()
    s = Store(retention_seconds=600)
    cp = checkpoint.Checkpointer()
    written = []
    for stop in range(100, 2001, 100):  # past the retention: blocks expire, columns are reclaimed
        write_rows(s, stop - 100, stop)
        cp.save(s, inc)
        written.append((cp.last.blocks_written, cp.last.blocks_kept, cp.last.keys_encoded))
        checkpoint.save(s, full)
        assert not segments(full)
        assert everything(restored(inc)) == everything(restored(full)) == everything(s), stop
    # each block was written once: blocks kept from earlier checkpoints, a few new ones per checkpoint
    assert sum(w for w, _, _ in written[3:]) <= len(written[3:]) and max(k for _, k, _ in written) >= 2, written
    # the keys are encoded again only when a table's series changed
    cp.save(s, inc)
    assert (cp.last.blocks_written, cp.last.keys_encoded) == (0, 0)
    assert everything(restored(inc)) == everything(s)  # the keys written from the checkpointer's deflated copy
    with s.lock:
        encoded = {n: len(checkpoint.encode_keys(t.keys)) for n, t in s.tables.items()}
    assert all(len(cp._keys[n][2]) < size for n, size in encoded.items()), (encoded, cp._keys)
    # segments whose blocks all expired are gone; the rest are named by the manifest
    with s.lock:
        live = sum(len(t.blocks) for t in s.tables.values())
    assert 1 <= len(segments(inc)) <= live


def test_a_segment_removed_behind_the_checkpointers_back_is_written_again(tmp_path):
    s = Store(retention_seconds=600)
    cp = checkpoint.Checkpointer()
    write_rows(s, 0, 900)
    cp.save(s, tmp_path)
    checkpoint.save(s, tmp_path)  # a full checkpoint by someone else: every segment goes
    assert not segments(tmp_path)
    write_rows(s, 900, 950)
    cp.save(s, tmp_path)
    assert cp.last.blocks_kept == 0 and segments(tmp_path)
    assert everything(restored(tmp_path)) == everything(s)


def test_restore_through_a_checkpointer_keeps_its_segments(tmp_path):
    s = Store(retention_seconds=600)
    cp = checkpoint.Checkpointer()
    write_rows(s, 0, 900)
    cp.save(s, tmp_path)
    before = segments(tmp_path)
    s2 = Store(retention_seconds=600)
    cp2 = checkpoint.Checkpointer()
    assert cp2.restore(s2, tmp_path, lambda t: {"cpu": 1.0, "cg": 2.0}[t]).restored
    write_rows(s2, 900, 950)
    cp2.save(s2, tmp_path)
    # the restored blocks stay where they are; only the restored hot rows (sealed at restore) are new
    assert cp2.last.blocks_kept >= 2 and cp2.last.blocks_written <= 2, cp2.last
    assert before <= segments(tmp_path)
    write_rows(s, 900, 950)
    assert everything(restored(tmp_path)) == everything(s)


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "foreign name"])
def test_a_damaged_segment_is_reported_and_the_next_checkpoint_is_whole(tmp_path, damage):
    s = Store(retention_seconds=600)
    cp = checkpoint.Checkpointer()
    write_rows(s, 0, 600)
    cp.save(s, tmp_path)
    write_rows(s, 600, 900)
    cp.save(s, tmp_path)
    segs = sorted(segments(tmp_path))
    assert len(segs) >= 2
    victim = tmp_path / segs[0]
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "flipped":
        b = bytearray(victim.read_bytes())
        b[len(b) // 2] ^= 0x5A
        victim.write_bytes(bytes(b))
    else:  # a manifest naming a file outside the checkpoint's own
        m = (tmp_path / checkpoint.FILENAME).read_bytes()
        (tmp_path / checkpoint.FILENAME).write_bytes(m.replace(segs[0].encode(), b"../" + segs[0][3:].encode()))
    s2 = Store(retention_seconds=600)
    cp2 = checkpoint.Checkpointer()
    res = cp2.restore(s2, tmp_path, lambda t: {"cpu": 1.0, "cg": 2.0}[t])
    assert not res.restored and res.error and "moved to" in res.error, res
    assert s2.series_count == 0 and not s2.tables
    assert not (tmp_path / checkpoint.FILENAME).exists() and list(tmp_path.glob("store.npz.corrupt-*"))
    # the agent goes on: its next checkpoint writes everything it holds, and removes the unnamed segments
    write_rows(s2, 1000, 1100)
    cp2.save(s2, tmp_path)
    assert segs[0] not in segments(tmp_path) and segs[1] not in segments(tmp_path)
    assert everything(restored(tmp_path)) == everything(s2)


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from cri_resmgr.store import Store, checkpoint
    from test_checkpoint_incremental import write_rows
    s = Store(retention_seconds=600)
    cp = checkpoint.Checkpointer()
    i = 0
    while True:
        write_rows(s, i, i + 37)
        i += 37
        cp.save(s, Path({d!r}))
        print(i, flush=True)
""")


def test_kill_9_during_checkpoints_leaves_a_consistent_one(tmp_path):
    """A process checkpointing as fast as it can is killed at random moments; every time, the directory restores
    to the rows of one complete checkpoint (the deterministic series, every row up to the table's seq)."""
    rng = np.random.default_rng(5)
    d = tmp_path / "state"
    d.mkdir()
    code = CHILD.format(repo=str(REPO), tests=str(REPO / "tests"), d=str(d))
    for attempt in range(6):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        for _ in range(3 + attempt):  # let it write a few checkpoints (seals, expiries, reclaims)
            assert p.stdout.readline(), "the child died"
        time.sleep(float(rng.uniform(0, 0.05)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        s = restored(d)
        rows = s.tables["cpu"].seq
        ref = Store(retention_seconds=600)
        write_rows(ref, 0, rows)
        assert everything(s) == everything(ref), attempt
        # clean up as a new start would: the next checkpoint of the restored store
        checkpoint.save(s, d)
        assert {f.name for f in d.iterdir()} == {checkpoint.FILENAME}  # no segment, no torn temporary file
        for f in d.iterdir():
            f.unlink()


def test_keys_round_trip_and_malformed_keys_are_refused():
    keys = [("m_total", (("a", "1"), ("b", "x"))), None, ("g", ()), ("m_total", (("a", "2"), ("b", "x")))]
    data = checkpoint.encode_keys(keys)
    assert checkpoint.decode_keys(data) == keys
    assert data.count(b'"x"') == 1  # each label pair written once
    good = json.loads(data)
    for bad in ([], {"metrics": [], "pairs": []}, {**good, "keys": [[0, 9]]}, {**good, "keys": [[0, -1]]},
                {**good, "keys": [[5]]}, {**good, "keys": [[]]}, {**good, "keys": [["0"]]}, {**good, "keys": [[True]]},
                {**good, "pairs": [["a"]]}, {**good, "pairs": [[1, 2]]}, {**good, "metrics": [7]},
                {**good, "keys": 7}):
        with pytest.raises((ValueError, KeyError, TypeError)):
            checkpoint.decode_keys(json.dumps(bad).encode())
