"""The AVX-512 BPF object and its loaders. Description tests open the object with libbpf without loading
it (no privileges); the load tests need root and run the real program on this kernel."""

import errno
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cri_resmgr.ebpf import avx512 as A
from cri_resmgr.ebpf.libbpf import (
    BPF_MAP_TYPE_PERCPU_ARRAY,
    BPF_MAP_TYPE_PERCPU_HASH,
    ENOTSUPP,
    BpfObject,
    Libbpf,
    LibbpfError,
)
from cri_resmgr.ebpf.probe import check_kernel_headers, probe_capabilities

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def libbpf():
    try:
        return Libbpf()
    except LibbpfError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def bpf_object(libbpf) -> Path:
    """The object `make bpf` builds; built here when clang is present but the build has not run yet."""
    if not A.DEFAULT_OBJECT.exists():
        if not (shutil.which("clang") and Path("/usr/include/bpf/bpf_helpers.h").exists()):
            pytest.skip("BPF object not built and clang/libbpf-dev not installed (apt: clang libbpf-dev)")
        subprocess.run(["make", "--no-print-directory", "bpf"], cwd=REPO, check=True)
    assert A.DEFAULT_OBJECT.exists(), "make bpf did not produce the object"
    return A.DEFAULT_OBJECT


def test_object_describes_maps_and_programs_as_the_header_says(bpf_object, libbpf):
    d = A.describe_object(bpf_object, libbpf)
    counts, totals = d.maps[A.COUNTS_MAP], d.maps[A.CPU_TOTALS_MAP]
    assert (counts.type, counts.key_size, counts.value_size) == (BPF_MAP_TYPE_PERCPU_HASH, A.KEY.size, A.COUNTS.size)
    assert (totals.type, totals.key_size, totals.value_size, totals.max_entries) == (
        BPF_MAP_TYPE_PERCPU_ARRAY, 4, A.CPU_TOTALS.size, 1)
    assert counts.max_entries == 4096  # the default in the C source; the loader overrides it
    assert d.programs == A.PROGRAMS
    assert d.rodata_size == A.CONFIG.size
    assert (A.KEY.size, A.COUNTS.size, A.CPU_TOTALS.size, A.CONFIG.size) == (16, 24, 24, 8)


def test_object_is_built_for_bpf_with_btf(bpf_object):
    head = bpf_object.read_bytes()[:20]
    assert head[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", head, 18)[0] == 247  # e_machine EM_BPF (include/uapi/linux/elf-em.h)
    assert b".BTF" in bpf_object.read_bytes() and b".BTF.ext" in bpf_object.read_bytes()  # CO-RE relocations


def test_max_entries_and_rodata_are_settable_before_load(bpf_object, libbpf):
    with BpfObject(bpf_object, libbpf) as obj:
        obj.set_max_entries(A.COUNTS_MAP, 777)
        name = obj.rodata_map_name()
        obj.set_initial_value(name, A.CONFIG.pack(1, 0))
        assert obj.maps()[A.COUNTS_MAP].max_entries == 777
        assert obj.initial_value(name) == A.CONFIG.pack(1, 0)
        with pytest.raises(LibbpfError, match="Invalid argument|size"):
            obj.set_initial_value(name, b"\0" * 3)  # wrong size is refused by libbpf


def test_open_of_a_non_bpf_file_is_an_error_with_reason(tmp_path, libbpf):
    bad = tmp_path / "x.o"
    bad.write_text("not an ELF file")
    with pytest.raises(LibbpfError, match=r"bpf_object__open_file\(.*x\.o\)"):
        BpfObject(bad, libbpf)
    with pytest.raises(A.LoaderError, match="bpf_object__open_file"):
        A.LibbpfSource(tmp_path / "missing.o", 64, False, libbpf)


def test_counts_sum_over_cpus_and_keys_round_trip():
    c = A.sum_counts([(1, 10, 5), (2, 20, 9), (0, 1, 0)])
    assert c == A.Counts(3, 31, 9)
    assert c + A.Counts(1, 1, 4) == A.Counts(4, 32, 9)
    k = A.CounterKey(123456789, 42)
    assert A.decode_key(A.encode_key(k)) == k


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CAP_BPF+CAP_PERFMON)")


def _ready(bpf_object):
    """Skip unless the program can load here. A CPU without AVX-512 still runs it (the x86_fpu and sched
    tracepoints fire on any x86 CPU; the ZMM_Hi256 bit is never set), so the CPU check is not a reason: these
    tests count switches, not AVX-512."""
    r = probe_capabilities(Path("/sys"), Path("/proc"), bpf_object, Path("/lib/modules"))
    problems = [c.reason for c in (r.kernel, r.privileges) if not c.ok] + r.libbpf_problems()
    if problems:
        pytest.skip("; ".join(problems))


@needs_root
def test_loaded_program_counts_switches_per_process(bpf_object, libbpf):
    _ready(bpf_object)
    src = A.LibbpfSource(bpf_object, 1024, key_by_tgid=True, lb=libbpf)
    try:
        assert src.capacity == 1024 and sorted(src.attached) == sorted(A.PROGRAMS.values())
        p = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(50): time.sleep(0.002)"])
        p.wait()
        snap = src.read()
        mine = [c for k, c in snap.counts.items() if k.tgid == p.pid]
        assert mine and mine[0].switches >= 50, mine  # each sleep switches the process out
        assert mine[0].avx512_switches == 0  # a sleeping interpreter does not touch zmm0-15's upper halves
        assert len(snap.cpus) == libbpf.num_possible_cpus()
        assert sum(c.switches for c in snap.cpus) >= sum(c.switches for c in snap.counts.values())
        later = src.read()
        assert sum(c.switches for c in later.cpus) >= sum(c.switches for c in snap.cpus)  # monotonic
        key = next(k for k in snap.counts if k.tgid == p.pid)
        final = src.retire([key])
        assert final[key].switches >= mine[0].switches
        assert key not in src.read().counts and src.retire([key]) == {}
    finally:
        src.close()


@needs_root
def test_full_map_counts_failed_inserts(bpf_object, libbpf):
    _ready(bpf_object)
    src = A.LibbpfSource(bpf_object, 64, key_by_tgid=True, lb=libbpf)
    try:
        # 100 short-lived processes, each a new key: more than the 64 entries the map has
        for _ in range(10):
            procs = [subprocess.Popen(["sleep", "0.01"]) for _ in range(10)]
            for p in procs:
                p.wait()
        snap = src.read()
        assert len(snap.counts) <= 64
        assert snap.failed_inserts > 0
        time.sleep(0.05)
        assert src.read().failed_inserts >= snap.failed_inserts
    finally:
        src.close()


def test_bcc_loader_without_kernel_headers_fails_with_reason():
    if A.find_bcc() is None:
        pytest.skip("bcc not installed (apt: python3-bpfcc)")
    release = os.uname().release
    if check_kernel_headers(Path("/lib/modules"), release, Path("/sys")).ok:
        pytest.skip("this kernel has headers: bcc would compile here")
    # The probe refuses this host before bcc is tried (test_avx512_probe); here real bcc is asked anyway and its
    # failure must come back as a LoaderError naming the source, not as bcc's bare Exception.
    with pytest.raises(A.LoaderError, match="bcc could not compile avx512_bcc.c: Failed to compile BPF module"):
        A.BccSource(64, key_by_tgid=False)


@needs_root
def test_bcc_loader_counts_per_process_where_headers_exist(bpf_object):
    """Runs only where this kernel has headers (bcc's premise); CI's kernel has none, so it skips there."""
    if A.find_bcc() is None:
        pytest.skip("bcc not installed (apt: python3-bpfcc)")
    if not check_kernel_headers(Path("/lib/modules"), os.uname().release, Path("/sys")).ok:
        pytest.skip("no kernel headers for this kernel: bcc cannot compile here")
    src = A.BccSource(1024, key_by_tgid=True)
    try:
        p = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(50): time.sleep(0.002)"])
        p.wait()
        snap = src.read()
        (mine,) = [c for k, c in snap.counts.items() if k.tgid == p.pid]
        assert mine.switches >= 50 and mine.avx512_switches == 0, mine
        key = next(k for k in snap.counts if k.tgid == p.pid)
        assert src.retire([key])[key].switches >= mine.switches and key not in src.read().counts
    finally:
        src.close()


@needs_root
def test_batch_read_of_the_loaded_map_matches_the_per_key_walk(bpf_object, libbpf):
    """BPF_MAP_LOOKUP_BATCH on the real loaded counts map gives what the get_next_key/lookup walk gives: the
    same keys, and for processes that have exited (their counts frozen) the same counts; for live ones counts
    between the walk before and the walk after. Read whole, and in chunks of 7 (the batch token carried on)."""
    _ready(bpf_object)
    src = A.LibbpfSource(bpf_object, 1024, key_by_tgid=True, lb=libbpf)
    try:
        procs = [subprocess.Popen(["sleep", "0.01"]) for _ in range(30)]
        for p in procs:
            p.wait()
        exited = {p.pid for p in procs}
        before = src.read_counts_by_key()
        batch = src.read_counts_batch()
        assert batch is not None, "this kernel (>= 5.6) has batch lookup for per-CPU hashes"
        raw = src.counts.lookup_batch(chunk=7)
        assert raw is not None
        chunked = {A.decode_key(bytes(k)): src._decode(src.counts, bytes(v)) for k, v in zip(*raw, strict=True)}
        after = src.read_counts_by_key()
        assert len(chunked) == len(raw[0])  # no key twice across the chunks
        for got in (batch, chunked):
            assert set(before) <= set(got) <= set(after)  # nothing deletes keys here: the key set only grows
            for k, c in got.items():
                b, a = before.get(k, A.Counts()), after[k]
                assert b.switches <= c.switches <= a.switches and b.avx512_switches <= c.avx512_switches
                assert b.last_avx512_ns <= c.last_avx512_ns <= a.last_avx512_ns
            dead = {k for k in got if k.tgid in exited}
            assert len(dead) == len(exited)  # every exited process has its key, each with switches counted
            assert all(got[k] == before[k] == after[k] and got[k].switches > 0 for k in dead)
        assert src.read().counts.keys() >= set(before) and src.batch  # read() took the batch path
    finally:
        src.close()


@needs_root
def test_read_falls_back_to_the_key_walk_where_the_kernel_has_no_batch_lookup(bpf_object):
    """A kernel without BPF_MAP_LOOKUP_BATCH (before 5.6: EINVAL) or without it for the map type (ENOTSUPP):
    the first read says so and walks the keys, and later reads do not ask again."""
    _ready(bpf_object)
    for err in (errno.EINVAL, ENOTSUPP):
        lb = Libbpf()  # its own function table: the fake below must not leak into other tests
        calls = []

        def no_batch(*args, err=err, calls=calls):
            calls.append(args)
            return -err

        lb.lib.bpf_map_lookup_batch = no_batch
        src = A.LibbpfSource(bpf_object, 256, key_by_tgid=True, lb=lb)
        try:
            p = subprocess.Popen(["sleep", "0.01"])
            p.wait()
            snap = src.read()
            assert not src.batch and len(calls) == 1
            assert any(k.tgid == p.pid and c.switches > 0 for k, c in snap.counts.items())  # counted all the same
            src.read()
            assert len(calls) == 1
        finally:
            src.close()
    lb = Libbpf()
    lb.lib.bpf_map_lookup_batch = lambda *args: -errno.EPERM  # any other error is an error, not "unsupported"
    src = A.LibbpfSource(bpf_object, 256, key_by_tgid=True, lb=lb)
    try:
        with pytest.raises(A.LoaderError, match="bpf_map_lookup_batch"):
            src.read()
    finally:
        src.close()
