import subprocess
import sys
from pathlib import Path

import pytest

from cri_resmgr.config import Config, ConfigError, build_config, env_overrides, load_config, parse_listen


def problems(**kw):
    with pytest.raises(ConfigError) as ei:
        build_config(env={}, **kw)
    return ei.value.problems


def test_defaults_are_valid_and_match_architecture_contract():
    cfg = build_config({}, env={"NODE_NAME": "n1"})
    assert cfg.listen == "127.0.0.1:8891"
    assert str(cfg.paths.sysfs) == "/sys" and str(cfg.paths.cgroup) == "/sys/fs/cgroup"
    assert str(cfg.paths.proc) == "/proc" and str(cfg.paths.resctrl) == "/sys/fs/resctrl"
    assert str(cfg.run_dir) == "/var/run/cri-resmgr" and str(cfg.state_dir) == "/var/lib/cri-resmgr"
    assert cfg.node_name == "n1"


def test_unknown_key_is_named_with_its_path():
    assert problems(file_data={"collectors": {"cgroup": {"intervall_seconds": 1}}}) == [
        "collectors.cgroup.intervall_seconds: unknown key"
    ]


def test_wrong_type_names_key_and_value():
    (p,) = problems(file_data={"store": {"retention_seconds": "lots"}})
    assert p.startswith("store.retention_seconds:") and "'lots'" in p


def test_impossible_values_are_rejected():
    (p,) = problems(file_data={"collectors": {"cpu": {"interval_seconds": 0}}})
    assert p.startswith("collectors.cpu.interval_seconds:") and "greater than or equal to 0.1" in p
    (p,) = problems(file_data={"listen": "127.0.0.1:70000"})
    assert p.startswith("listen:") and "outside 0..65535" in p
    (p,) = problems(file_data={"listen": "nohostport"})
    assert p.startswith("listen:") and "HOST:PORT" in p


def test_node_override_applies_only_to_its_node():
    data = {"collectors": {"cpu": {"interval_seconds": 3}},
            "node_overrides": {"big-1": {"collectors": {"cpu": {"interval_seconds": 7}}, "log_level": "debug"}}}
    assert build_config(data, env={"NODE_NAME": "big-1"}).collectors.cpu.interval_seconds == 7
    assert build_config(data, env={"NODE_NAME": "big-1"}).log_level == "debug"
    other = build_config(data, env={"NODE_NAME": "small-1"})
    assert other.collectors.cpu.interval_seconds == 3 and other.log_level == "info"


def test_node_override_for_any_option_including_paths_and_dirs():
    data = {"api": {"read_token": "scrape-token"},
            "node_overrides": {"n": {"paths": {"sysfs": "/host/sys"}, "state_dir": "/data/crm", "listen": "0.0.0.0:9"}}}
    cfg = build_config(data, env={"NODE_NAME": "n"})
    assert str(cfg.paths.sysfs) == "/host/sys" and str(cfg.state_dir) == "/data/crm" and cfg.listen == "0.0.0.0:9"


def test_bad_override_for_another_node_is_still_an_error():
    data = {"node_overrides": {"elsewhere": {"collectors": {"cpu": {"interval_seconds": -1}}}}}
    (p,) = problems(file_data=data)
    assert p.startswith("node_overrides.elsewhere.collectors.cpu.interval_seconds:")


def test_node_name_from_file_selects_override():
    data = {"node_name": "x", "node_overrides": {"x": {"log_level": "error"}}}
    assert build_config(data, env={"NODE_NAME": "y"}).log_level == "error"


def test_env_overrides_nested_keys_and_types():
    assert env_overrides({"CRI_RESMGR_PATHS__SYSFS": "/tmp/s", "CRI_RESMGR_STORE__CHECKPOINT": "false",
                          "OTHER": "1"}) == {"paths": {"sysfs": "/tmp/s"}, "store": {"checkpoint": False}}
    cfg = build_config({"listen": "127.0.0.1:1"}, env={"CRI_RESMGR_LISTEN": "127.0.0.1:2",
                                                       "CRI_RESMGR_COLLECTORS__CPU__INTERVAL_SECONDS": "9"})
    assert cfg.listen == "127.0.0.1:2" and cfg.collectors.cpu.interval_seconds == 9


def test_env_error_is_attributed_to_environment():
    with pytest.raises(ConfigError) as ei:
        build_config({}, env={"CRI_RESMGR_COLLECTORS__CPU__INTERVAL_SECONDS": "fast"})
    assert ei.value.source == "environment"
    assert ei.value.problems[0].startswith("collectors.cpu.interval_seconds:")


def test_flags_win_over_env_and_file():
    cfg = build_config({"listen": "127.0.0.1:1"}, env={"CRI_RESMGR_LISTEN": "127.0.0.1:2"},
                       flags={"listen": "127.0.0.1:3"})
    assert cfg.listen == "127.0.0.1:3"


def test_yaml_syntax_error_gives_line(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("listen: ok\nstore:\n  retention_seconds: [1,\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f, env={})
    assert "line" in ei.value.problems[0] and "not valid YAML" in ei.value.problems[0]


def test_non_mapping_file_and_missing_file(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml", env={})


def test_empty_file_means_defaults(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("")
    assert load_config(f, env={}).listen == Config().listen


def test_parse_listen_ipv6():
    assert parse_listen("[::1]:8891") == ("::1", 8891)


def test_cli_exits_2_naming_the_key(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("collectors:\n  cgroup:\n    interval_seconds: -5\n")
    r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "run", "--config", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "collectors.cgroup.interval_seconds" in r.stderr and "greater than or equal to 0.1" in r.stderr
