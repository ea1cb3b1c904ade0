"""The AVX-512 capability probe: parsers on inline text, checks on fixture trees (tests/avx512fs.py), and the
loader choice. Each negative case must come back as a reason, never as an exception."""

from pathlib import Path

import pytest

from cri_resmgr.collectors.avx512 import Avx512Collector
from cri_resmgr.config import Avx512CollectorConfig, Paths
from cri_resmgr.ebpf import probe as P
from cri_resmgr.topology import Topology

from .avx512fs import CAP_BPF_PERFMON, Host, make_btf, make_host


def test_parse_cap_eff_reads_hex_mask_and_none_when_absent():
    assert P.parse_cap_eff("Name:\tx\nCapEff:\t000001ffffffffff\n") == (1 << 41) - 1
    assert P.parse_cap_eff("CapEff:\t0000000000000000") == 0
    assert P.parse_cap_eff("Name: x\n") is None
    assert P.parse_cap_eff("CapEff:\tzz\n") is None


def test_parse_kernel_release_takes_leading_version():
    assert P.parse_kernel_release("6.18.44-fc-v1045\n") == (6, 18, 44)
    assert P.parse_kernel_release("5.15.0-91-generic") == (5, 15, 0)
    assert P.parse_kernel_release("4.19") == (4, 19, 0)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        P.parse_kernel_release("linux")


def test_parse_cpu_flags_first_processor():
    text = "processor : 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor : 1\nflags : fpu\n"
    assert "avx512f" in P.parse_cpu_flags(text)
    assert P.parse_cpu_flags("processor : 0\n") == frozenset()


def test_btf_string_lookup_and_malformed_blobs():
    blob = make_btf(["btf_trace_sched_switch"])
    assert P.btf_has_names(blob, ["btf_trace_sched_switch", "btf_trace_x86_fpu_regs_deactivated", "sched"]) == {
        "btf_trace_sched_switch": True, "btf_trace_x86_fpu_regs_deactivated": False, "sched": False}
    with pytest.raises(ValueError, match="magic"):
        P.btf_has_names(b"\x7fELF" + bytes(40), ["x"])
    with pytest.raises(ValueError, match="too short"):
        P.btf_has_names(b"\x9f\xeb", ["x"])
    with pytest.raises(ValueError, match="truncated"):
        P.btf_has_names(blob[:-5], ["x"])


def test_real_kernel_btf_describes_both_tracepoints():
    btf = Path("/sys/kernel/btf/vmlinux")
    if not btf.exists():
        pytest.skip("kernel without BTF")
    found = P.btf_has_names(btf.read_bytes(), ["btf_trace_x86_fpu_regs_deactivated", "btf_trace_sched_switch"])
    assert all(found.values()), found


def report(tmp_path: Path, host: Host, object_exists: bool = True, headers: bool = False) -> P.CapabilityReport:
    sysfs, proc = make_host(tmp_path, host)
    obj = tmp_path / "avx512.bpf.o"
    if object_exists:
        obj.write_bytes(b"\x7fELF")
    modules = tmp_path / "modules"
    if headers:
        (modules / host.release / "build/include").mkdir(parents=True)
    return P.probe_capabilities(sysfs, proc, obj, modules)


def test_good_host_chooses_libbpf(tmp_path):
    r = report(tmp_path, Host())
    if not r.libbpf.ok:
        pytest.skip(f"system libbpf not loadable: {r.libbpf.reason}")
    assert r.common() == [] and r.libbpf_problems() == []
    assert P.choose_loader("auto", r) == P.LoaderChoice("libbpf", "libbpf CO-RE object")


@pytest.mark.parametrize("host, needle", [
    (Host(cap_eff=0), "not root and no CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN (missing CAP_BPF, CAP_PERFMON"),
    (Host(cap_eff=1 << 39), "missing CAP_PERFMON"),
    (Host(cpu_flags="fpu sse2 avx avx2"), "CPU without avx512f"),
    (Host(release="5.4.0-150-generic"), "kernel 5.4.0-150-generic is older than the minimum 5.11"),
    (Host(release="garbage"), "does not start with MAJOR.MINOR"),
])
def test_common_failures_are_reported_with_reason(tmp_path, host, needle):
    choice = P.choose_loader("auto", report(tmp_path, host))
    assert choice.loader is None
    assert needle in choice.reason


def test_cap_bpf_and_perfmon_suffice_without_root(tmp_path):
    r = report(tmp_path, Host(cap_eff=CAP_BPF_PERFMON))
    assert r.privileges.ok
    # before 5.8 there is no CAP_BPF: only CAP_SYS_ADMIN counts (and such kernels fail the minimum anyway)
    r = report(tmp_path / "old", Host(cap_eff=CAP_BPF_PERFMON, release="5.4.0"))
    assert not r.privileges.ok and "CAP_SYS_ADMIN" in r.privileges.reason


def test_no_btf_without_bcc_headers_names_both_loaders(tmp_path):
    r = report(tmp_path, Host(btf_names=None))
    assert not r.btf.ok and "no kernel BTF at" in r.btf.reason and "CONFIG_DEBUG_INFO_BTF" in r.btf.reason
    choice = P.choose_loader("auto", r)
    assert choice.loader is None
    assert "libbpf: no kernel BTF" in choice.reason and "bcc:" in choice.reason
    assert "no kernel headers for 6.18.44-fc-v1045" in choice.reason


def test_tracepoint_missing_from_btf_and_tracefs(tmp_path):
    r = report(tmp_path, Host(btf_names=["btf_trace_sched_switch"], tracefs_events=["sched/sched_switch"]))
    assert "tracepoint x86_fpu_regs_deactivated missing: not in kernel BTF" in r.btf.reason
    assert "tracepoint x86_fpu/x86_fpu_regs_deactivated missing from" in r.tracefs.reason
    assert "tracepoint x86_fpu_regs_deactivated missing" in P.choose_loader("auto", r).reason


def test_tracefs_unmounted_is_a_bcc_problem_only(tmp_path):
    r = report(tmp_path, Host(tracefs_events=None))
    assert "tracefs not mounted" in r.tracefs.reason
    assert r.btf.ok  # tp_btf attaches through BTF, tracefs is not needed for libbpf


def test_missing_object_says_how_to_build(tmp_path):
    r = report(tmp_path, Host(), object_exists=False)
    assert "not built (run `make bpf`" in r.object.reason
    assert P.choose_loader("libbpf", r).reason.startswith("libbpf loader: BPF object")


def test_bcc_chosen_without_btf_when_bcc_and_headers_exist(tmp_path):
    r = report(tmp_path, Host(btf_names=None), headers=True)
    if not r.bcc.ok:
        pytest.skip(r.bcc.reason)
    choice = P.choose_loader("auto", r)
    assert choice.loader == "bcc" and "libbpf unusable: no kernel BTF" in choice.reason
    # kheaders.tar.xz (CONFIG_IKHEADERS) counts as headers too
    r2 = report(tmp_path / "kh", Host(btf_names=None, kheaders=True))
    assert r2.kernel_headers.ok


def test_bcc_preference_reports_missing_package_or_headers(tmp_path):
    r = report(tmp_path, Host())
    choice = P.choose_loader("bcc", r)
    assert choice.loader is None and choice.reason.startswith("bcc loader: ")
    assert ("no kernel headers" in choice.reason) or ("python3-bpfcc" in choice.reason)


def test_collector_probe_reports_reason_on_fixture_host(tmp_path):
    sysfs, proc = make_host(tmp_path, Host(cap_eff=0))
    cg = tmp_path / "cgroup"
    (cg / "cgroup.controllers").parent.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpu memory\n")
    col = Avx512Collector(Avx512CollectorConfig(object_path=tmp_path / "none.o"),
                          Paths(sysfs=sysfs, proc=proc, cgroup=cg), Topology())
    pr = col.probe()
    assert not pr.ok
    assert "not root and no CAP_BPF+CAP_PERFMON" in pr.reason
    assert col.probe() == pr  # cached until the retry time, not re-probed on every run


def test_config_rejects_a_window_shorter_than_the_interval_and_bad_values():
    from cri_resmgr.config import ConfigError, build_config

    cfg = build_config({"collectors": {"avx512": {"interval_seconds": 1, "window_seconds": 5}}}, env={})
    assert cfg.collectors.avx512.window_seconds == 5 and cfg.collectors.avx512.active_threshold == 0.1
    with pytest.raises(ConfigError, match=r"collectors\.avx512: .*window_seconds \(1\.0\) must be at least "
                                          r"interval_seconds \(2\.0\)"):
        build_config({"collectors": {"avx512": {"window_seconds": 1}}}, env={})
    with pytest.raises(ConfigError, match=r"collectors\.avx512\.map_entries"):
        build_config({"collectors": {"avx512": {"map_entries": 10}}}, env={})
    with pytest.raises(ConfigError, match=r"collectors\.avx512\.loader"):
        build_config({"collectors": {"avx512": {"loader": "bpftrace"}}}, env={})
