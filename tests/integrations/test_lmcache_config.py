"""Config of the LMCache backend: option parsing and the 0.3.x ``external_backend.*`` trap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastckpt.integrations.lmcache.config import check_config, check_cli, parse_options

GOOD = {
    "storage_plugins": ["fastckpt"],
    "extra_config": {
        "storage_plugin.fastckpt.module_path": "fastckpt.integrations.lmcache.backend",
        "storage_plugin.fastckpt.class_name": "FastCkptKVBackend",
        "storage_plugin.fastckpt.path": "/mnt/array/kv",
        "storage_plugin.fastckpt.max_bytes": 1 << 30,
        "storage_plugin.fastckpt.o_direct": "false",  # env JSON often carries strings
        "storage_plugin.fastckpt.read_threads": "8",
    },
}
OLD_03X = {
    "external_backends": ["fastckpt"],
    "extra_config": {
        "external_backend.fastckpt.module_path": "fastckpt.integrations.lmcache.backend",
        "external_backend.fastckpt.class_name": "FastCkptKVBackend",
        "external_backend.fastckpt.path": "/mnt/array/kv",
    },
}


def test_good_config_parses():
    assert check_config(GOOD) == []
    name, o = parse_options(GOOD)
    assert name == "fastckpt" and o.store.path == "/mnt/array/kv"
    assert o.store.max_bytes == 1 << 30 and o.store.o_direct is False and o.read_threads == 8
    assert o.store.durable is True and o.store.piece_bytes == 4 << 20


def test_old_external_backend_keys_are_detected():
    cfg = dict(OLD_03X, storage_plugins=OLD_03X["external_backends"])  # what 0.5.x makes of it
    warns = check_config(cfg)
    assert any("0.3.x" in w and "storage_plugin.fastckpt.module_path" in w for w in warns)
    assert any("lacks storage_plugin.fastckpt.module_path" in w for w in warns)


@pytest.mark.parametrize("bad", [
    {"storage_plugin.fastckpt.max_bytes": "5GB"},
    {"storage_plugin.fastckpt.o_direct": "maybe"},
    {"storage_plugin.fastckpt.piece_bytes": 1000},
    {"storage_plugin.fastckpt.read_threads": 0},
    {"storage_plugin.fastckpt.path": ""},
])
def test_bad_values_are_refused_with_the_key_named(bad):
    cfg = {"storage_plugins": GOOD["storage_plugins"], "extra_config": {**GOOD["extra_config"], **bad}}
    with pytest.raises(ValueError) as ei:
        parse_options(cfg)
    assert "fastckpt" in str(ei.value) or "piece_bytes" in str(ei.value)


def test_cli_checks_the_environment_form(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LMCACHE_STORAGE_PLUGINS", "fastckpt")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps({**GOOD["extra_config"],
                                                           "storage_plugin.fastckpt.path": str(tmp_path)}))
    assert check_cli([]) == 0 and f"fastckpt -> {tmp_path}" in capsys.readouterr().out
    monkeypatch.delenv("LMCACHE_STORAGE_PLUGINS")
    monkeypatch.setenv("LMCACHE_EXTERNAL_BACKENDS", "fastckpt")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(OLD_03X["extra_config"]))
    assert check_cli([]) == 1 and "0.3.x" in capsys.readouterr().out


def _yaml(tmp_path, extra: dict, top: dict | None = None) -> str:
    yaml = pytest.importorskip("yaml")
    cfg = {"storage_plugins": GOOD["storage_plugins"], "extra_config": {**GOOD["extra_config"], **extra}, **(top or {})}
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture
def _cli(capsys):
    """``check_cli([config.yaml])`` on a YAML file written from ``extra``/``top``: (rc, stdout, stderr)."""
    def run(tmp_path, extra: dict, top: dict | None = None):
        rc = check_cli([_yaml(tmp_path, extra, top)])
        r = capsys.readouterr()
        return rc, r.out, r.err
    return run


def test_cli_module_prints_one_line_not_a_traceback(tmp_path):
    """The real command line (python -m ...) on the issue's inputs."""
    for extra in ({"storage_plugin.fastckpt.max_bytes": "5GB"}, {"storage_plugin.fastckpt.piece_bytes": 1000},
                  {"storage_plugin.fastckpt.read_thread": 8}):
        r = subprocess.run([sys.executable, "-m", "fastckpt.integrations.lmcache.config", _yaml(tmp_path, extra)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
        (line,) = r.stdout.strip().splitlines()
        assert list(extra)[0] in line, line


@pytest.mark.parametrize("key, value, expected", [
    ("max_bytes", "5GB", "an integer number of bytes"),
    ("max_bytes", -1, "an integer number of bytes >= 0"),
    ("piece_bytes", 1000, "a positive multiple of 4096"),
    ("read_threads", 0, "an integer >= 1"),
    ("o_direct", "maybe", "true or false"),
    ("min_rescan_interval_s", "soon", "a number of seconds >= 0"),
])
def test_cli_names_a_bad_value_in_one_line(_cli, tmp_path, key, value, expected):
    rc, out, err = _cli(tmp_path, {f"storage_plugin.fastckpt.{key}": value})
    assert rc == 1 and "Traceback" not in out + err, out + err
    (line,) = out.strip().splitlines()
    assert f"storage_plugin.fastckpt.{key}" in line and expected in line and repr(value) in line, line


def test_cli_suggests_the_bytes_of_a_size_string(_cli, tmp_path):
    rc, out, _ = _cli(tmp_path, {"storage_plugin.fastckpt.max_bytes": "5GiB"})
    assert rc == 1 and "write 5368709120" in out


@pytest.mark.parametrize("typo, suggestion", [
    ("storage_plugin.fastckpt.read_thread", "storage_plugin.fastckpt.read_threads"),
    ("storage_plugin.fastckpt.maxbytes", "storage_plugin.fastckpt.max_bytes"),
    ("storage_plugin.fastckpt.odirect", "storage_plugin.fastckpt.o_direct"),
    ("storage_plugin.fastckp.durable", "storage_plugin.fastckpt.durable"),  # the plugin name misspelt
])
def test_cli_flags_an_unknown_key_with_the_closest_known_one(_cli, tmp_path, typo, suggestion):
    rc, out, err = _cli(tmp_path, {typo: 4})
    assert rc == 1 and "Traceback" not in out + err, out + err
    (line,) = out.strip().splitlines()
    assert typo in line and f"did you mean {suggestion}?" in line, line


def test_cli_flags_a_misspelt_top_level_key(_cli, tmp_path):
    rc, out, _ = _cli(tmp_path, {}, top={"storage_plugin": ["fastckpt"]})
    assert rc == 1 and "did you mean 'storage_plugins'?" in out


def test_cli_refuses_a_malformed_shape_without_a_traceback(_cli, tmp_path):
    for top in ({"extra_config": ["a", "b"]}, {"storage_plugins": "fastckpt"}):
        rc, out, err = _cli(tmp_path, {}, top=top)
        assert rc == 2 and "Traceback" not in out + err and err.startswith("error: "), out + err


def test_good_config_still_ok_from_the_cli(_cli, tmp_path):
    (tmp_path / "kv").mkdir()
    rc, out, err = _cli(tmp_path, {"storage_plugin.fastckpt.path": str(tmp_path / "kv")})
    assert rc == 0 and out.strip() == f"ok: fastckpt -> {tmp_path / 'kv'}", out + err


def test_a_kv_folder_that_does_not_exist_is_a_warning(_cli, tmp_path):
    """README's /mnt/array/kv on a host where the array is not mounted: 'ok', and the backend would
    have filled the root file system (a README-only trial)."""
    rc, out, err = _cli(tmp_path, {"storage_plugin.fastckpt.path": str(tmp_path / "not-mounted" / "kv")})
    assert rc == 1 and "does not exist" in out and f"file system of {tmp_path}" in out, out + err


def test_bad_values_all_named_by_parse_options():
    cfg = {"storage_plugins": ["fastckpt"], "extra_config": {**GOOD["extra_config"],
           "storage_plugin.fastckpt.max_bytes": "5GB", "storage_plugin.fastckpt.stale_tmp_s": "never"}}
    with pytest.raises(ValueError) as ei:
        parse_options(cfg)
    msg = str(ei.value)
    assert "storage_plugin.fastckpt.max_bytes" in msg and "storage_plugin.fastckpt.stale_tmp_s" in msg
    assert len([w for w in check_config(cfg) if "expected" in w]) == 2


def test_lmcache_really_ignores_the_old_keys(tmp_path):
    """The trap is real in the installed LMCache: the 0.3.x config loads no plugin."""
    pytest.importorskip("lmcache")
    code = (
        "import json, sys, torch, asyncio\n"
        "from lmcache.v1.config import LMCacheEngineConfig\n"
        "from lmcache.v1.metadata import LMCacheMetadata\n"
        "from lmcache.v1.storage_backend import CreateStorageBackends\n"
        "cfg = LMCacheEngineConfig.from_dict(json.loads(sys.argv[1]))\n"
        "meta = LMCacheMetadata('m', 1, 1, 0, 0, torch.bfloat16, (2, 2, 256, 2, 64))\n"
        "print(json.dumps(list(CreateStorageBackends(cfg, meta, asyncio.new_event_loop()))))\n"
    )
    for cfg, want in ((OLD_03X, False), (GOOD, True)):
        cfg = json.loads(json.dumps(cfg))
        key = [k for k in cfg["extra_config"] if k.endswith(".path")][0]
        cfg["extra_config"][key] = str(tmp_path / "kv")
        cfg["max_local_cpu_size"] = 0.1
        r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONHASHSEED="0"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("fastckpt" in json.loads(r.stdout.strip().splitlines()[-1])) is want


@pytest.mark.parametrize("key, typo", [("class_name", "FastCkptKVBackendX"),
                                       ("module_path", "fastckpt.integrations.lmcache.backnd"),
                                       ("module_path", "fastkpt.integrations.lmcache.backend"),
                                       ("class_name", "FastckptKVBackend")])
def test_cli_flags_a_typo_in_our_module_or_class_name(_cli, tmp_path, key, typo):
    """README's yaml with a typo in class_name or module_path said "ok, but ... configures no fastckpt
    storage plugin", exit 0 (a README-only trial): LMCache would fail to load the plugin."""
    (tmp_path / "kv").mkdir()
    rc, out, err = _cli(tmp_path, {"storage_plugin.fastckpt.path": str(tmp_path / "kv"), f"storage_plugin.fastckpt.{key}": typo})
    assert rc == 1 and "Traceback" not in out + err, out + err
    assert f"{key} {typo!r}" in out and "did you mean module_path fastckpt.integrations.lmcache.backend, " \
        "class_name FastCkptKVBackend?" in out, out


def test_cli_flags_a_misspelt_storage_plugin_prefix(_cli, tmp_path):
    """``storage_plugn.fastckpt.max_bytes`` passed as "ok": the capacity silently unlimited (a second
    README-only trial)."""
    (tmp_path / "kv").mkdir()
    rc, out, _ = _cli(tmp_path, {"storage_plugin.fastckpt.path": str(tmp_path / "kv"),
                                 "storage_plugn.fastckpt.max_bytes": 1 << 40})
    assert rc == 1 and "did you mean storage_plugin.fastckpt.max_bytes?" in out, out
